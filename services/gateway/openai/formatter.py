"""OpenAI completions and chat bodies and SSE chunks, one `Formatter` per choice of a request.

A completion's text is the generation's; a chat's goes through deepseek-recipe's parser (`ChatStream`):
reasoning, answer and tool calls apart. Logprobs are the engine's, the token strings the tokenizer's (or
``token_id:N`` with vLLM's ``return_tokens_as_token_ids``), a chat token's ``bytes`` its own bytes (the pieces of a
character split over tokens join; vLLM gives their U+FFFD string's), a completion token's ``text_offset`` where it
starts in the choice's text (`text_offsets`). A chat chunk carries the logprobs of the tokens since the previous
chunk that carried output, on the chunk whose text they complete (never on the role chunk before any text).
`choice_pieces` merges the choices of an ``n > 1`` request as they come.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import Any

from services.engine.delta import Delta
from services.engine.finish_reason import FinishReason
from services.gateway.choices import merged_pieces
from services.gateway.frontend import Frontend, finite_logprob
from services.gateway.generation import Generation, Piece
from services.gateway.openai.chat_stream import THINK_END_ID, THINK_START_ID, ChatStream
from services.gateway.openai.protocol import OpenAIRequest


class Formatter:
    """Builds completions or chat bodies and chunks for one choice of a request."""

    def __init__(
        self, frontend: Frontend, request: OpenAIRequest, generation: Generation, chat: bool, first_index: int = 0
    ) -> None:
        self.frontend = frontend
        self.request = request
        self.generation = generation
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{generation.request_id}"  # as vLLM: the request's id inside
        self.object = "chat.completion" if chat else "text_completion"
        self._strings: dict[int, str] = {}  # token id -> its own string, for logprobs
        self._bytes: dict[int, bytes] = {}  # token id -> its own bytes, for chat logprobs
        # A chat's reasoning / answer / tool-call parser (deepseek-recipe); None for a completion.
        self.chat_stream = (
            ChatStream(request.chat, self.id, frontend.served_model, generation.created)
            if request.chat is not None
            else None
        )
        self._pending: list[Piece] = []  # pieces whose logprobs / token_ids no chat chunk has carried yet
        # The choice's index in every body and chunk: first_index (the choices of a batch's earlier prompts) + its own.
        self.index = first_index + generation.index
        self.first = True  # no chunk of this choice was sent yet
        self.num_output_tokens = 0  # this choice's output tokens so far
        self._num_chars = 0  # characters of this completion choice's text streamed so far (its text_offsets)
        # A chat with thinking on (its prompt ends with <think>) reasons until </think>: the output tokens
        # before it are usage's reasoning_tokens (the marker itself is not counted).
        self._reasoning = self.chat and generation.prompt_token_ids[-1:] == [THINK_START_ID]
        self.num_reasoning_tokens = 0  # this choice's reasoning tokens so far

    async def resolve(self, pieces: list[Piece]) -> None:
        """Looks up the strings of the pieces' tokens, and of the prompt's with prompt logprobs (only those
        that logprobs or prompt_logprobs return)."""
        ids: set[int] = set()
        if self.request.num_logprobs is not None:
            ids |= {t for p in pieces for t in p.delta.token_ids}
            ids |= {i for p in pieces for top in p.delta.top_logprobs or [] for i, _ in top}
        for p in pieces:
            if p.delta.prompt_logprobs is not None:
                ids |= set(self.generation.prompt_token_ids)
                ids |= {i for top in p.delta.prompt_top_logprobs or [] for i, _ in top}
        missing = sorted(ids - self._strings.keys())
        if missing and not self.request.tokens_as_ids:
            strings, token_bytes = await self.frontend.tokenizer.token_texts(missing)
            self._strings.update(zip(missing, strings))
            self._bytes.update(zip(missing, token_bytes))

    def _token(self, token_id: int) -> str:
        if self.request.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._strings.get(token_id, "")

    def _token_bytes(self, token_id: int) -> list[int]:
        """The token's own bytes (a piece of a UTF-8 character included); its shown string's with token_id:N."""
        return list(self._bytes.get(token_id, self._token(token_id).encode()))

    def logprobs(self, pieces: list[Piece], start: int = 0) -> dict[str, Any] | None:
        """OpenAI's logprobs of the pieces' tokens; ``start``: a completion's characters before the pieces' text
        (the echoed prompt's included), where their text_offsets begin."""
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
                        "bytes": self._token_bytes(t),
                        "top_logprobs": [
                            {"token": self._token(i), "logprob": v, "bytes": self._token_bytes(i)} for i, v in top
                        ],
                    }
                    for t, lp, top in zip(ids, lps, tops)
                ]
            }
        tokens: list[str] = [self._token(t) for t in ids]
        offsets: list[int] = []
        at = start
        for p in pieces:  # each piece's first token is placed exactly: its text starts where the text was
            offsets += text_offsets(p.text, [self._token(t) for t in p.delta.token_ids], at)
            at += len(p.text)
        token_logprobs: list[float | None] = list(lps)
        top_dicts: list[dict[str, float] | None] = [{self._token(i): v for i, v in top} for top in tops]
        prompt = next((p.delta for p in pieces if p.delta.prompt_logprobs is not None), None)
        if self.request.echo and prompt is not None:  # OpenAI's echo: the prompt's tokens lead, the first unscored
            prompt_tokens = [self._token(t) for t in self.generation.prompt_token_ids]
            offsets = text_offsets(self.generation_prompt(), prompt_tokens, 0) + offsets
            tokens = prompt_tokens + tokens
            token_logprobs = [None, *(finite_logprob(x) for x in prompt.prompt_logprobs or [])] + token_logprobs
            top_dicts = [
                None,
                *(
                    {self._token(i): finite_logprob(v) for i, v in top[: self.request.num_logprobs]}
                    for top in prompt.prompt_top_logprobs or []
                ),
            ] + top_dicts
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_dicts, "text_offset": offsets}

    def prompt_logprobs(self, pieces: list[Piece]) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's prompt_logprobs: None for the first prompt token, then per token {token id: {logprob, rank,
        decoded_token}} for the token itself and the top-n at its position. A top-n entry's rank is its place
        (1 first); the prompt token's is the engine's (how many tokens have a logprob >= its own)."""
        prompt = next((p.delta for p in pieces if p.delta.prompt_logprobs is not None), None)
        if self.request.prompt_logprobs is None or prompt is None:
            return None
        out: list[dict[str, dict[str, Any]] | None] = [None]
        num = self.request.prompt_logprobs
        lps = prompt.prompt_logprobs or []
        tops = prompt.prompt_top_logprobs or [[] for _ in lps]
        ranks = prompt.prompt_ranks or [None for _ in lps]
        for token_id, lp, top, rank in zip(self.generation.prompt_token_ids[1:], lps, tops, ranks):
            entry = {str(token_id): self._prompt_entry(token_id, lp, rank)}
            for place, (i, v) in enumerate(top[:num], 1):
                entry.setdefault(str(i), self._prompt_entry(i, v, place))
            out.append(entry)
        return out

    def _prompt_entry(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": finite_logprob(logprob), "rank": rank, "decoded_token": self._token(token_id)}

    def count_reasoning(self, delta: Delta) -> None:
        """Adds the delta's reasoning tokens: those before </think>; when the reasoning never ends, all but the
        end or stop token that ended the request (neither is reasoning)."""
        token_ids = delta.token_ids
        if delta.stop_token_id is not None and token_ids[-1:] == [delta.stop_token_id]:
            token_ids = token_ids[:-1]
        for position, token_id in enumerate(token_ids if self._reasoning else ()):
            if token_id == THINK_END_ID:
                self._reasoning = False
                self.num_reasoning_tokens += position
                return
        if self._reasoning:
            self.num_reasoning_tokens += len(token_ids)

    def usage(self, num_output_tokens: int, num_reasoning_tokens: int = 0) -> dict[str, Any]:
        """OpenAI's usage, with prompt_tokens_details.cached_tokens (the prefix cache's hit); a chat's has
        completion_tokens_details.reasoning_tokens."""
        n = self.generation.num_prompt_tokens
        usage: dict[str, Any] = {
            "prompt_tokens": n,
            "completion_tokens": num_output_tokens,
            "total_tokens": n + num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": self.generation.num_cached_tokens},
        }
        if self.chat:
            usage["completion_tokens_details"] = {"reasoning_tokens": num_reasoning_tokens}
        return usage

    def _shown(self, piece: Piece) -> Piece:
        """The piece as the answer shows it: with vLLM's echo of max_tokens 0, without what was generated."""
        if not self.request.echo_only:
            return piece
        delta = piece.delta
        hidden = dataclasses.replace(delta, token_ids=[], logprobs=[], top_logprobs=None, num_output_tokens=0)
        return Piece(hidden, "")

    def body(self, pieces: list[Piece]) -> dict[str, Any]:
        pieces = [self._shown(p) for p in pieces]
        text = "".join(p.text for p in pieces)
        for p in pieces:
            self.count_reasoning(p.delta)
        final = pieces[-1].delta
        echoed = self.generation_prompt() if self.request.echo else ""
        choice: dict[str, Any] = {
            "index": self.index,
            "logprobs": self.logprobs(pieces, len(echoed)),
            "finish_reason": final.finish_reason,
        }
        token_ids = [t for p in pieces for t in p.delta.token_ids]
        if self.request.return_token_ids:  # vLLM's: the choice's ids (a completion's choice also the prompt's)
            choice["token_ids"] = token_ids
            if self.chat_stream is None:
                choice["prompt_token_ids"] = self.generation.prompt_token_ids
        if self.chat_stream is not None:
            self.chat_stream.push(text, final.num_output_tokens)
            self.chat_stream.finish(final.finish_reason or FinishReason.STOP)
            message, recipe_reason = self.chat_stream.message()
            choice["message"] = message
            if recipe_reason == "tool_calls" and final.finish_reason == FinishReason.STOP:
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = echoed + text
        body = {
            "id": self.id,
            "object": self.object,
            "created": self.generation.created,
            "model": self.frontend.served_model,
            "choices": [choice],
            "usage": self.usage(final.num_output_tokens, self.num_reasoning_tokens),
        }
        if self.request.return_token_ids and self.chat_stream is not None:  # vLLM's place: a chat's body
            body["prompt_token_ids"] = self.generation.prompt_token_ids
        if self.request.prompt_logprobs is not None:  # vLLM's places: a completion's choice, a chat's body
            (choice if self.chat_stream is None else body)["prompt_logprobs"] = self.prompt_logprobs(pieces)
        return body

    def generation_prompt(self) -> str:
        return self.request.echo_text or ""

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.generation.created,
            "model": self.frontend.served_model,
        }

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        return dict(self._envelope(), choices=[], usage=usage)

    def chunks(self, piece: Piece) -> list[dict[str, Any]]:
        """The SSE chunks of one piece: a completion's one, or as many as the chat parser completes."""
        first, self.first = self.first, False
        piece = self._shown(piece)
        self.num_output_tokens = piece.delta.num_output_tokens
        self.count_reasoning(piece.delta)
        if self.chat_stream is None:
            echoed = self.generation_prompt() if first and self.request.echo else ""
            choice = {
                "index": self.index,
                "text": echoed + piece.text,
                "logprobs": self.logprobs([piece], self._num_chars + len(echoed)),
                "finish_reason": piece.delta.finish_reason,
            }
            if self.request.return_token_ids:  # vLLM's: each chunk its new ids, the first the prompt's too
                choice["token_ids"] = list(piece.delta.token_ids)
                if first:
                    choice["prompt_token_ids"] = self.generation.prompt_token_ids
            self._num_chars += len(echoed) + len(piece.text)
            return [dict(self._envelope(), choices=[choice])]
        if self.request.num_logprobs is not None or self.request.return_token_ids:
            self._pending.append(piece)
        chunks = self.chat_stream.push(piece.text, len(piece.delta.token_ids))
        if piece.delta.finish_reason is not None:
            chunks += self.chat_stream.finish(piece.delta.finish_reason)
        for chunk in chunks:
            chunk["object"] = f"{self.object}.chunk"
            for choice in chunk["choices"]:
                choice["index"] = self.index
        carrier = next((c for c in reversed(chunks) if any(map(_carries_output, c["choices"]))), None)
        if carrier is not None and self._pending:  # the tokens' text (or the end) is in this chunk
            if self.request.num_logprobs is not None:
                carrier["choices"][0]["logprobs"] = self.logprobs(self._pending)
            if self.request.return_token_ids:
                carrier["choices"][0]["token_ids"] = [t for p in self._pending for t in p.delta.token_ids]
            self._pending = []
        if first and chunks and self.request.return_token_ids:  # vLLM's: the first chunk carries the prompt's
            chunks[0]["prompt_token_ids"] = self.generation.prompt_token_ids
        return chunks

    def pending_pieces(self) -> list[Piece]:
        return self._pending


def request_usage(fmts: list[Formatter], num_output_tokens: int, num_reasoning_tokens: int) -> dict[str, Any]:
    """A whole request's usage: its output tokens, and each prompt's tokens (and cached tokens) counted once, however
    many choices share it (a completions batch has several prompts)."""
    usage = fmts[0].usage(num_output_tokens, num_reasoning_tokens)
    prompts: dict[int, Generation] = {}  # one generation per prompt: its first choice's
    for fmt in fmts:
        prompts.setdefault(id(fmt.request), fmt.generation)
    num_prompt_tokens = sum(g.num_prompt_tokens for g in prompts.values())
    usage["prompt_tokens"] = num_prompt_tokens
    usage["total_tokens"] = num_prompt_tokens + num_output_tokens
    usage["prompt_tokens_details"] = {"cached_tokens": sum(g.num_cached_tokens for g in prompts.values())}
    return usage


def _carries_output(choice: dict[str, Any]) -> bool:
    """Whether a chat chunk's choice has text, tool calls or the finish reason (the role chunk has none)."""
    delta = choice.get("delta", {})
    return bool(
        delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls") or choice.get("finish_reason")
    )


def text_offsets(text: str, strings: list[str], start: int) -> list[int]:
    """Each token's character offset (from ``start``) in ``text``, the text of these tokens: where its string
    begins, taken in order. A token whose string is not at its place (a special token the text leaves out, or
    part of a UTF-8 character its string shows as U+FFFD) sits there with no width, and the next token whose
    string is found within a few characters places the rest again."""
    offsets, at = [], 0
    for string in strings:
        found = text.find(string, at, at + len(string) + 4) if string else -1
        offsets.append(start + (at if found < 0 else found))
        if found >= 0:
            at = found + len(string)
    return offsets


async def choice_pieces(fmts: list[Formatter]) -> AsyncIterator[tuple[Formatter, Piece]]:
    """Every choice's pieces as they come (one choice: in order, without tasks)."""
    async for i, piece in merged_pieces([fmt.generation for fmt in fmts]):
        yield fmts[i], piece
