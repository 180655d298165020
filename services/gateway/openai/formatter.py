"""OpenAI completions and chat bodies and SSE chunks, one `Formatter` per choice of a request.

A completion's text is the generation's; a chat's goes through deepseek-recipe's parser (`ChatStream`):
reasoning, answer and tool calls apart. Logprobs are the engine's, the token strings the tokenizer's (or
``token_id:N`` with vLLM's ``return_tokens_as_token_ids``); a chat chunk carries the logprobs of the tokens
since the previous chunk it sent. `choice_pieces` merges the choices of an ``n > 1`` request as they come.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from services.engine.finish_reason import FinishReason
from services.gateway.frontend import Frontend, finite_logprob
from services.gateway.generation import Generation, Piece
from services.gateway.openai.chat_stream import ChatStream
from services.gateway.openai.protocol import OpenAIRequest


class Formatter:
    """Builds completions or chat bodies and chunks for one choice of a request."""

    def __init__(self, frontend: Frontend, request: OpenAIRequest, generation: Generation, chat: bool) -> None:
        self.frontend = frontend
        self.request = request
        self.generation = generation
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{generation.request_id}"  # as vLLM: the request's id inside
        self.object = "chat.completion" if chat else "text_completion"
        self._strings: dict[int, str] = {}  # token id -> its own string, for logprobs
        # A chat's reasoning / answer / tool-call parser (deepseek-recipe); None for a completion.
        self.chat_stream = (
            ChatStream(request.chat, self.id, frontend.served_model, generation.created)
            if request.chat is not None
            else None
        )
        self._pending: list[Piece] = []  # pieces whose logprobs no chat chunk has carried yet
        self.index = generation.index  # the choice's index in every body and chunk
        self.first = True  # no chunk of this choice was sent yet
        self.num_output_tokens = 0  # this choice's output tokens so far

    async def resolve(self, pieces: list[Piece]) -> None:
        """Looks up the strings of the pieces' tokens (only when logprobs were asked for)."""
        if self.request.num_logprobs is None:
            return
        ids = {t for p in pieces for t in p.delta.token_ids}
        ids |= {i for p in pieces for top in p.delta.top_logprobs or [] for i, _ in top}
        missing = sorted(ids - self._strings.keys())
        if missing and not self.request.tokens_as_ids:
            self._strings.update(zip(missing, await self.frontend.tokenizer.token_strings(missing)))

    def _token(self, token_id: int) -> str:
        if self.request.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._strings.get(token_id, "")

    def logprobs(self, pieces: list[Piece]) -> dict[str, Any] | None:
        if self.request.num_logprobs is None:
            return None
        ids = [t for p in pieces for t in p.delta.token_ids]
        lps = [finite_logprob(x) for p in pieces for x in p.delta.logprobs]
        tops = [
            [(i, finite_logprob(v)) for i, v in top]
            for p in pieces
            for top in (p.delta.top_logprobs or [[] for _ in p.delta.token_ids])
        ]
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._token(t),
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [{"token": self._token(i), "logprob": v, "bytes": None} for i, v in top],
                    }
                    for t, lp, top in zip(ids, lps, tops)
                ]
            }
        return {
            "tokens": [self._token(t) for t in ids],
            "token_logprobs": lps,
            "top_logprobs": [{self._token(i): v for i, v in top} for top in tops],
            "text_offset": [],
        }

    def usage(self, num_output_tokens: int) -> dict[str, int]:
        n = self.generation.num_prompt_tokens
        return {"prompt_tokens": n, "completion_tokens": num_output_tokens, "total_tokens": n + num_output_tokens}

    def body(self, pieces: list[Piece]) -> dict[str, Any]:
        text = "".join(p.text for p in pieces)
        final = pieces[-1].delta
        choice: dict[str, Any] = {
            "index": self.index,
            "logprobs": self.logprobs(pieces),
            "finish_reason": final.finish_reason,
        }
        if self.chat_stream is not None:
            self.chat_stream.push(text, final.num_output_tokens)
            self.chat_stream.finish(final.finish_reason or FinishReason.STOP)
            message, recipe_reason = self.chat_stream.message()
            choice["message"] = message
            if recipe_reason == "tool_calls" and final.finish_reason == FinishReason.STOP:
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = (self.generation_prompt() if self.request.echo else "") + text
        return {
            "id": self.id,
            "object": self.object,
            "created": self.generation.created,
            "model": self.frontend.served_model,
            "choices": [choice],
            "usage": self.usage(final.num_output_tokens),
        }

    def generation_prompt(self) -> str:
        return self.request.args.prompt_text or ""

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.generation.created,
            "model": self.frontend.served_model,
        }

    def usage_chunk(self, num_output_tokens: int) -> dict[str, Any]:
        return dict(self._envelope(), choices=[], usage=self.usage(num_output_tokens))

    def chunks(self, piece: Piece) -> list[dict[str, Any]]:
        """The SSE chunks of one piece: a completion's one, or as many as the chat parser completes."""
        first, self.first = self.first, False
        self.num_output_tokens = piece.delta.num_output_tokens
        if self.chat_stream is None:
            text = (self.generation_prompt() if first and self.request.echo else "") + piece.text
            choice = {
                "index": self.index,
                "text": text,
                "logprobs": self.logprobs([piece]),
                "finish_reason": piece.delta.finish_reason,
            }
            return [dict(self._envelope(), choices=[choice])]
        if self.request.num_logprobs is not None:
            self._pending.append(piece)
        chunks = self.chat_stream.push(piece.text, len(piece.delta.token_ids))
        if piece.delta.finish_reason is not None:
            chunks += self.chat_stream.finish(piece.delta.finish_reason)
        for chunk in chunks:
            chunk["object"] = f"{self.object}.chunk"
            for choice in chunk["choices"]:
                choice["index"] = self.index
                if self._pending:
                    choice["logprobs"] = self.logprobs(self._pending)
                    self._pending = []
        return chunks

    def pending_pieces(self) -> list[Piece]:
        return self._pending


async def choice_pieces(fmts: list[Formatter]) -> AsyncIterator[tuple[Formatter, Piece]]:
    """Every choice's pieces as they come (one choice: in order, without tasks)."""
    if len(fmts) == 1:
        async for piece in fmts[0].generation:
            yield fmts[0], piece
        return
    queue: asyncio.Queue[tuple[Formatter, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(fmt: Formatter) -> None:
        try:
            async for piece in fmt.generation:
                await queue.put((fmt, piece))
        except Exception as err:  # handed to the reader, which raises it
            await queue.put((fmt, err))
        await queue.put((fmt, None))

    tasks = [asyncio.ensure_future(pump(fmt)) for fmt in fmts]
    try:
        remaining = len(fmts)
        while remaining:
            fmt, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield fmt, item
    finally:
        for task in tasks:
            task.cancel()
