"""The live requests' streams by request id: the event loop opens them and finds the ones to abort, the step thread
turns the engine's outputs into their deltas. One lock guards the table and each stream's counts."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

from services.engine.delta import Delta
from services.engine.finish_reason import FinishReason
from services.engine.outputs import RequestOutput
from services.engine.reporting.observer import EngineObserver, RequestTimes
from services.engine.request_stream import RequestStream

log = logging.getLogger("shinkai.engine")


class QueueFull(Exception):
    """More requests are unfinished than the service accepts; retry after `retry_after_s`."""

    def __init__(self, num_unfinished: int, retry_after_s: int = 1) -> None:
        super().__init__(f"the engine queue is full ({num_unfinished} requests unfinished); retry later")
        self.retry_after_s = retry_after_s


class StreamTable:
    def __init__(self, observer: EngineObserver, abort: Callable[[str], None]) -> None:
        self.observer = observer  # phase times and metrics of each request (called from the step thread)
        self.abort = abort  # what a stream closed early calls with its request id
        self._streams: dict[str, RequestStream] = {}  # request id -> stream; written under _lock by both threads
        self._lock = threading.Lock()

    def open(
        self,
        request_id: str,
        client_request_id: str,
        num_prompt_tokens: int,
        num_choices: int,
        max_live: int,
    ) -> RequestStream:
        """A new request's stream, read on the running event loop. Raises QueueFull when ``max_live`` streams are
        live, ValueError for a ``request_id`` already live; nothing is opened then."""
        with self._lock:
            if len(self._streams) >= max_live:
                raise QueueFull(len(self._streams))
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = RequestStream(
                self.abort,
                request_id,
                client_request_id,
                asyncio.get_running_loop(),
                self.observer.submitted(),
                num_prompt_tokens,
                num_choices,
            )
            self._streams[request_id] = stream
        return stream

    def num_live(self) -> int:
        with self._lock:
            return len(self._streams)

    def request_ids(self, client_request_id: str | None = None) -> list[str]:
        """The live streams' request ids; with ``client_request_id``, those of that client id whose final delta is
        not queued yet."""
        with self._lock:
            if client_request_id is None:
                return list(self._streams)
            return [
                request_id
                for request_id, s in self._streams.items()
                if s.client_request_id == client_request_id and not s.finished
            ]

    def times(self, request_id: str) -> RequestTimes | None:
        stream = self._streams.get(request_id)  # one dict read: atomic; times are step-thread state
        return stream.times if stream is not None else None

    def deliver(self, out: RequestOutput) -> None:
        """The step thread: a request's output gained tokens or ended; its stream gets the new part as a delta."""
        with self._lock:
            stream = self._streams.get(out.request_id)
            if stream is None:
                return
            start = stream.num_sent_by_choice[out.index]
            stream.num_sent_by_choice[out.index] = len(out.token_ids)
            with_prompt = (  # complete: every prompt position's (a request aborted mid-prefill has fewer)
                out.prompt_logprobs is not None
                and len(out.prompt_logprobs) == len(out.prompt_token_ids) - 1
                and not stream.prompt_logprobs_sent[out.index]
            )
            if with_prompt:
                stream.prompt_logprobs_sent[out.index] = True
            stream.num_sent = sum(stream.num_sent_by_choice)
            last = False
            if out.finished:
                stream.num_unfinished_choices -= 1
                last = stream.num_unfinished_choices == 0
            if last:
                stream.finished = True
                del self._streams[out.request_id]
        delta = Delta(
            token_ids=out.token_ids[start:],
            logprobs=out.logprobs[start:],
            top_logprobs=out.top_logprobs[start:] if out.top_logprobs is not None else None,
            num_output_tokens=len(out.token_ids),
            finish_reason=out.finish_reason,
            stop_token_id=out.stop_token_id,
            index=out.index,
            last=last,
            prompt_logprobs=list(out.prompt_logprobs or ()) if with_prompt else None,
            prompt_top_logprobs=list(out.prompt_top_logprobs or ()) if with_prompt else None,
            prompt_ranks=list(out.prompt_ranks or ()) if with_prompt else None,
            num_cached_tokens=out.num_cached_tokens,
        )
        if delta.token_ids:
            self.observer.tokens(stream.times)
        if last:
            self.observer.finished(stream.times, out.finish_reason or FinishReason.ERROR, stream.num_sent)
        _post(stream, delta)

    def deliver_final(self, request_id: str, reason: FinishReason, stop_token_id: int | None, why: str | None) -> None:
        """The step thread: the request's stream ends with one last, empty delta (an error, an add that failed, the
        closing delta of an abort), unless its final delta was queued already."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.finished = True
        self.observer.finished(stream.times, reason, stream.num_sent)
        if why:
            log.error("request %s ended with %s: %s", request_id, reason, why)
        final = Delta([], [], None, stream.num_sent, finish_reason=reason, stop_token_id=stop_token_id, last=True)
        _post(stream, final)


def _post(stream: RequestStream, delta: Delta) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.deltas.put_nowait, delta)
    except RuntimeError:  # the reader's event loop is closed: nobody is listening any more
        pass
