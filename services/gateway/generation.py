"""A started request's pieces: the engine's deltas with their detokenized text, stop strings applied.

Stop strings are matched here, on the text (services/gateway/stop_strings.py), as vLLM's output processor
does: the engine knows token ids only. A request with stop strings detokenizes its deltas token by token,
so the token whose text completes a match is known; the piece of that token is the request's last (finish
reason "stop", its token counts and logprobs cut after that token), and the engine's request is aborted
there, which frees its blocks. Tokens the engine produced past the match are never shown nor counted.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any

from observability import tracing
from observability.metrics import RequestMetrics
from services.engine.finish_reason import FinishReason
from services.engine.service import Delta
from services.gateway.admission import Ticket
from services.gateway.backends import DeltaStream, Detokenizer, DetokenizerLost
from services.gateway.stop_strings import StopStrings


@dataclass
class Piece:
    """One delta of a generation with its text."""

    delta: Delta
    # Text new in this delta; never splits a UTF-8 character. On the final piece it includes the flush.
    text: str


def _cut(delta: Delta, num_tokens: int) -> Delta:
    """The delta's first ``num_tokens`` tokens, as the request's final delta (a stop string ended it)."""
    dropped = len(delta.token_ids) - num_tokens
    return dataclasses.replace(
        delta,
        token_ids=delta.token_ids[:num_tokens],
        logprobs=delta.logprobs[:num_tokens],
        top_logprobs=None if delta.top_logprobs is None else delta.top_logprobs[:num_tokens],
        num_output_tokens=delta.num_output_tokens - dropped,
        finish_reason=FinishReason.STOP,
        stop_token_id=None,
    )


class Generation:
    """A started request's pieces. ``close()`` (or leaving ``async for`` early and closing) aborts it."""

    def __init__(
        self,
        metrics: RequestMetrics,
        stream: DeltaStream,
        detokenizer: Detokenizer,
        request_id: str,
        client_request_id: str,
        num_prompt_tokens: int,
        endpoint: str,
        arrival: float,
        span: Any = None,
        detokenize_span: Any = None,
        stop: StopStrings | None = None,
        index: int = 0,
        prompt_token_ids: list[int] | None = None,
        ticket: Ticket | None = None,
    ) -> None:
        self.metrics = metrics
        self.stream = stream
        self.detokenizer = detokenizer
        self.request_id = request_id  # unique: the engine and the scheduler know the request by it
        self.client_request_id = client_request_id  # the id Abort takes (the request_id when the client gave none)
        self.num_prompt_tokens = num_prompt_tokens
        self.endpoint = endpoint
        self.created = int(time.time())
        self._start = arrival  # monotonic time the request arrived: TTFT and e2e count from here
        # The request's span and its detokenize child (None when tracing is off); both end with the final piece.
        self.span = span
        self.detokenize_span = detokenize_span
        self.stop = stop  # the request's stop strings; None: it has none
        self.index = index  # which of the request's choices this is (0 to n - 1)
        self.prompt_token_ids = prompt_token_ids or []  # the prompt as this side encoded it (image spans not expanded)
        # The request's place in its tenant's admission account (shared by its choices); None: not admitted here.
        self.ticket = ticket
        self._last: float | None = None  # time of the latest token-bearing delta
        self.finish_reason: FinishReason | None = None
        self.num_cached_tokens = 0  # prompt tokens the engine took from its prefix cache (the final delta's)

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Piece:
        if self.finish_reason is not None:
            raise StopAsyncIteration
        delta = await self.stream.__anext__()
        now = time.monotonic()
        if delta.token_ids:
            if self._last is None:
                self.metrics.ttft.observe(now - self._start)
                if self.ticket is not None:
                    self.ticket.started()
            else:
                gap = (now - self._last) / len(delta.token_ids)
                for _ in delta.token_ids:  # vLLM's count: one inter-token latency per token after the first
                    self.metrics.itl.observe(gap)
            self._last = now
        try:
            if self.stop is None:
                text = await self.detokenizer.push(delta.token_ids)
                if delta.finish_reason is not None:
                    text += await self.detokenizer.finish()
            else:
                delta, text = await self._stop_strings(delta)
        except DetokenizerLost:  # no more text can be made: the request ends here, its blocks come back
            self.stream.close()
            delta, text = dataclasses.replace(delta, finish_reason=FinishReason.ERROR, stop_token_id=None), ""
        if delta.finish_reason is not None:
            self._finish(delta, now)
        return Piece(delta, text)

    async def _stop_strings(self, delta: Delta) -> tuple[Delta, str]:
        """The delta's text with the stop strings applied, token by token; the delta cut at a match."""
        assert self.stop is not None
        text = ""
        for i, token_id in enumerate(delta.token_ids):
            raw = await self.detokenizer.push([token_id])
            if i == len(delta.token_ids) - 1 and delta.finish_reason is not None:
                raw += await self.detokenizer.finish()
            text += self.stop.push(raw)
            if self.stop.matched is not None:
                self.stream.close()  # the engine's request ends here: its blocks come back
                return _cut(delta, i + 1), text
        if delta.finish_reason is not None:
            if not delta.token_ids:
                text += self.stop.push(await self.detokenizer.finish())
            if self.stop.matched is not None:
                return dataclasses.replace(delta, finish_reason=FinishReason.STOP, stop_token_id=None), text
            text += self.stop.flush()
        return delta, text

    def _finish(self, delta: Delta, now: float) -> None:
        assert delta.finish_reason is not None
        self.detokenizer.close()
        self.finish_reason = delta.finish_reason
        self.num_cached_tokens = delta.num_cached_tokens
        if self.ticket is not None:
            self.ticket.done()
        self.metrics.generation_tokens.inc(delta.num_output_tokens)
        if self.index == 0:  # a request's counts and latency once, by its first choice
            self.metrics.e2e.observe(now - self._start)
            self.metrics.count_finished(delta.finish_reason)
            self.metrics.prompt_tokens.inc(self.num_prompt_tokens)
        self._end_spans(delta.finish_reason, delta.num_output_tokens)

    def _end_spans(self, reason: FinishReason, num_output_tokens: int) -> None:
        tracing.end(self.detokenize_span)
        tracing.end(
            self.span,
            {
                "request.finish_reason": str(reason),
                "request.output_tokens": num_output_tokens,
                "request.cached_tokens": self.num_cached_tokens,
            },
            error=reason if reason == FinishReason.ERROR else None,
        )
        self.span = self.detokenize_span = None

    def close(self) -> None:
        """Aborts the request unless its final piece was read (a disconnect or cancel). Idempotent."""
        if self.finish_reason is None:
            self.finish_reason = FinishReason.ABORT
            if self.ticket is not None:
                self.ticket.done()
            if self.index == 0:
                self.metrics.count_finished(FinishReason.ABORT)
            self.detokenizer.close()
            self._end_spans(FinishReason.ABORT, 0)
        self.stream.close()
