"""OpenAI Responses and Anthropic Messages requests through deepseek-recipe, both directions.

`ProtocolStream` converts a body with the recipe's `ResponsesRequest` / `MessagesRequest` (its validation, its
defaults: thinking on, the model's temperature), gives the generation arguments (the tokenizer renders the
same body under the same protocol), and turns the generated text into the protocol's stream events or final
body with the recipe's chunk generator and `StreamProcessor`, as the chat endpoint does. Usage is the
engine's: prompt tokens in the ready chunk, each text chunk with its token count.
"""

from __future__ import annotations

import json
from typing import Any

import deepseek_recipe

from services.engine.finish_reason import FinishReason
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint
from services.engine.structured.recipe_constraint import recipe_constraint
from services.gateway import errors
from services.gateway.frontend import GenerateArgs
from services.tokenizer.chat import PROTOCOLS, RECIPE_MODEL, bounded

_RESPONSE = {"responses": deepseek_recipe.ResponsesResponse, "messages": deepseek_recipe.MessagesResponse}
_NAMES = {"responses": "OpenAI Responses", "messages": "Anthropic Messages"}
_FINISH = {FinishReason.LENGTH: deepseek_recipe.InferenceFinishReason.Length}
# Responses' terminal event per ending the recipe has no reason for: an abort leaves the answer incomplete;
# an engine error or a preemption the engine could not recover from fails it.
_RESPONSES_ENDING = {
    FinishReason.ABORT: "incomplete",
    FinishReason.PREEMPTED: "failed",
    FinishReason.ERROR: "failed",
}


class ProtocolStream:
    """One Responses or Messages request: its generation arguments, then its events."""

    def __init__(self, protocol: str, body: dict[str, Any], served_model: str, response_id: str) -> None:
        self.protocol = protocol
        if body.get("n", 1) not in (None, 1):  # neither protocol has choices: refused rather than ignored
            raise errors.invalid(f"n is not a field of the {_NAMES[protocol]} API: it returns one answer", "n")
        self.body = dict(body, model=RECIPE_MODEL)
        cls = PROTOCOLS[protocol]
        try:
            request = cls(json.dumps(self.body))
            echo = request.echo() if protocol == "responses" else None
            self.conversion = request.convert(deepseek_recipe.ConversionOptions())
        except (deepseek_recipe.ConversionError, ValueError, TypeError) as err:
            raise errors.invalid(bounded(str(err))) from err
        generator = cls.chunk_generator(self.conversion, response_id, served_model)
        if echo is not None:
            generator = generator.with_echo(echo)
        self._processor = deepseek_recipe.StreamProcessor(generator, self.conversion.parsing_options)
        self._response = _RESPONSE[protocol](response_id, served_model, 0, 0, 0)
        self.stream = self.conversion.stream  # the body asked for server-sent events
        # Why the engine ended the request other than by a stop or the length limit (abort, preempted,
        # error); None while it has not, or when it ended normally.
        self.failure: FinishReason | None = None

    def args(self, model: str) -> GenerateArgs:
        """What to generate: the body rendered under its protocol, with the recipe's inference options."""
        options = self.conversion.inference_options
        try:
            params = SamplingParams(
                max_tokens=options.max_tokens,
                temperature=1.0 if options.temperature is None else options.temperature,
                top_p=1.0 if options.top_p is None else options.top_p,
                seed=options.seed,
                constraint=self._constraint(),
            )
        except ValueError as err:
            raise errors.invalid(str(err)) from err
        args = GenerateArgs(model=model, endpoint=self.protocol, chat_body=self.body, chat_protocol=self.protocol)
        args.params = params
        # Stop sequences end the engine's request at their token (services/gateway/generation.py); the text
        # keeps them, so the recipe's parser finds them too, cuts them off and reports them (Anthropic's
        # stop_reason "stop_sequence" and stop_sequence).
        args.stop = tuple(self.conversion.parsing_options.stop_sequences)
        args.include_stop_str_in_output = True
        return args

    def _constraint(self) -> Constraint | None:
        """The recipe's output constraint (the body's text format or forced tool choice), parsed here so a bad one
        is a 400 before anything is queued."""
        output = self.conversion.inference_options.output_constraint
        if output is None:
            return None
        thinking = self.conversion.parsing_options.thinking_initial_stage is not None
        constraint = recipe_constraint(str(output.kind), output.schema, thinking)
        if constraint is not None:
            constraint.grammar()
        return constraint

    def ready(self, num_prompt_tokens: int) -> list[tuple[str | None, str]]:
        usage = deepseek_recipe.PromptUsage(prompt_tokens=num_prompt_tokens)
        return self._convert(self._processor.push(deepseek_recipe.InferenceChunk.ready(prompt_usage=usage)))

    def push(self, text: str, num_tokens: int) -> list[tuple[str | None, str]]:
        """(SSE event name, JSON data) of each event this text completes."""
        if (not text and not num_tokens) or self._processor.finished:
            return []  # the parser ended the answer itself at a stop sequence
        return self._convert(self._processor.push(deepseek_recipe.InferenceChunk.text(text, num_tokens)))

    def finish(self, reason: FinishReason) -> list[tuple[str | None, str]]:
        if self._processor.finished:
            return []
        recipe_reason = _FINISH.get(reason, deepseek_recipe.InferenceFinishReason.Stop)
        events = self._processor.push(deepseek_recipe.InferenceChunk.finish(recipe_reason))
        converted = self._convert(events + self._processor.finish())
        if reason in (FinishReason.STOP, FinishReason.LENGTH):
            return converted
        self.failure = reason
        if self.protocol == "messages":  # Anthropic's stream ends in an error event instead of message_stop
            kept = [(name, data) for name, data in converted if name not in ("message_delta", "message_stop")]
            return [*kept, ("error", json.dumps({"type": "error", "error": self.failure_error()}))]
        out = []
        for name, data in converted:
            if name in ("response.completed", "response.incomplete", "response.failed"):
                event = json.loads(data)
                event["response"] = self._failed(event["response"])
                name = event["type"] = f"response.{_RESPONSES_ENDING[reason]}"
                data = json.dumps(event)
            out.append((name, data))
        return out

    def failure_error(self) -> dict[str, str]:
        """Anthropic's error object for an engine that ended the request abnormally."""
        assert self.failure is not None
        kind = "api_error" if self.failure == FinishReason.ERROR else "overloaded_error"
        return {"type": kind, "message": self.failure_message()}

    def failure_message(self) -> str:
        return f"the engine ended the request before the answer was whole (finish reason {self.failure})"

    def _failed(self, response: dict[str, Any]) -> dict[str, Any]:
        """A Responses body with the engine's abnormal ending: "incomplete" for an abort, else "failed"."""
        assert self.failure is not None
        status = _RESPONSES_ENDING[self.failure]
        response["status"] = status
        response["incomplete_details"] = None  # OpenAI's reasons (max_output_tokens, content_filter) do not fit
        if status == "failed":
            response["error"] = {"code": "server_error", "message": self.failure_message()}
        return response

    def body_json(self) -> str:
        """The whole response (after `finish`)."""
        if self.failure is not None and self.protocol == "responses":
            return json.dumps(self._failed(json.loads(self._response.to_json())))
        return self._response.to_json()

    def close(self) -> None:
        self._processor.close()

    def _convert(self, events: list[Any]) -> list[tuple[str | None, str]]:
        out = []
        for event in events:
            out.append((self._response.sse_event_name(event), event.to_json()))
            self._response.accumulate(event)
        return out
