"""A chat request's response side through deepseek-recipe: generated text in, OpenAI chat chunks out.

The recipe's `StreamProcessor` with its `ChatCompletionChunkGenerator` parses the text as the model writes
it: the reasoning (up to ``</think>``, never shown) as ``reasoning_content``, the answer as ``content``, and
DSML tool-call blocks as ``tool_calls`` whose JSON arguments stream as they are generated (finish reason
``tool_calls``). It is fed text (`InferenceChunk.text`) that the gateway has already detokenized and cut
at stop strings, so the gateway needs no tokenizer of its own. What the recipe does not know is put right
here: the response's id, time and model name, the engine's finish reasons other than stop and length,
logprobs (ours, per token), usage (the engine's counts), vLLM's ``include_reasoning: false`` and OpenAI's
``parallel_tool_calls: false`` (the first tool call is kept).
"""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe

from services.engine.finish_reason import FinishReason
from services.gateway.openai.chat_options import ChatOptions
from services.tokenizer.chat import RECIPE_MODEL

# DeepSeek V4.1's thinking markers, each its own token of the vocabulary chat is served with: a prompt with
# thinking on ends with <think>, and the reasoning ends at </think>.
THINK_START_ID = 128821
THINK_END_ID = 128822
_RECIPE_FINISH = {FinishReason.LENGTH: deepseek_recipe.InferenceFinishReason.Length}


class ChatStream:
    """One chat request's chunks; feed it the generation's text in order, then `finish`."""

    def __init__(self, options: ChatOptions, response_id: str, model: str, created: int) -> None:
        body = dict(options.conversation, model=RECIPE_MODEL)
        request = deepseek_recipe.ChatCompletionRequest(json.dumps(body)).convert(deepseek_recipe.ConversionOptions())
        generator = deepseek_recipe.ChatCompletionRequest.chunk_generator(request, response_id, model)
        self._processor = deepseek_recipe.StreamProcessor(generator, request.parsing_options)
        self._response = deepseek_recipe.ChatCompletionResponse(response_id, model, created, 0, 0)
        self.options = options
        self.id = response_id
        self.model = model
        self.created = created
        self._chunks = self._processor.push(deepseek_recipe.InferenceChunk.ready())

    def push(self, text: str, num_tokens: int) -> list[dict[str, Any]]:
        """The chunks this text completes (the parser holds back what may still be a marker)."""
        raw = list(self._chunks)
        self._chunks = []
        if text:
            raw += self._processor.push(deepseek_recipe.InferenceChunk.text(text, num_tokens))
        return self._convert(raw)

    def finish(self, reason: FinishReason) -> list[dict[str, Any]]:
        """The last chunks; the final one carries the finish reason."""
        recipe_reason = _RECIPE_FINISH.get(reason, deepseek_recipe.InferenceFinishReason.Stop)
        raw = list(self._chunks) + self._processor.push(deepseek_recipe.InferenceChunk.finish(recipe_reason))
        raw += self._processor.finish()
        self._chunks = []
        chunks = self._convert(raw)
        for chunk in chunks:
            for choice in chunk["choices"]:
                if choice.get("finish_reason") is not None and not (
                    choice["finish_reason"] == "tool_calls" and reason == FinishReason.STOP
                ):
                    choice["finish_reason"] = str(reason)
        return chunks

    def message(self) -> tuple[dict[str, Any], str | None]:
        """The whole answer (after `finish`): the message and the recipe's finish reason."""
        body = json.loads(self._response.to_json())
        choice = body["choices"][0]
        return self._filter_message(choice["message"]), choice.get("finish_reason")

    def close(self) -> None:
        self._processor.close()

    def _convert(self, raw: list[Any]) -> list[dict[str, Any]]:
        chunks = []
        for item in raw:
            chunk = json.loads(item.to_json())
            self._response.accumulate(item)
            chunk.update(id=self.id, model=self.model, created=self.created)
            chunk.pop("usage", None)
            for choice in chunk["choices"]:
                self._filter_delta(choice["delta"])
            chunks.append(chunk)
        return chunks

    def _filter_delta(self, delta: dict[str, Any]) -> None:
        if not self.options.include_reasoning:
            delta.pop("reasoning_content", None)
        if not self.options.parallel_tool_calls and "tool_calls" in delta:
            delta["tool_calls"] = [call for call in delta["tool_calls"] if call.get("index", 0) == 0]
            if not delta["tool_calls"]:
                del delta["tool_calls"]

    def _filter_message(self, message: dict[str, Any]) -> dict[str, Any]:
        if message.get("content") == "" and (message.get("reasoning_content") or message.get("tool_calls")):
            message["content"] = None  # OpenAI's and vLLM's: no answer text besides the reasoning or calls
        if not self.options.include_reasoning:
            message.pop("reasoning_content", None)
        if not self.options.parallel_tool_calls and message.get("tool_calls"):
            message["tool_calls"] = message["tool_calls"][:1]
        for call in message.get("tool_calls") or []:
            call.pop("index", None)
        return message
