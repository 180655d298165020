"""The asyncio face of one engine replica: a step-loop thread around `Engine`, streams per request.

Invariants:
- Only the step thread touches the `Engine` (and so `scheduler_rs`); callers on the event loop send it
  commands through a thread-safe queue and get outputs back through per-request asyncio queues.
- One engine step runs at a time; commands (add, abort) are applied between steps, never during one.
- A request is known by its `request_id` (the gateway's, unique), unchanged down to the scheduler; a second
  live request with the same `request_id` is refused. `abort(client_request_id)` ends every live request
  with that client id (clients may reuse theirs).
- A stream that is closed or cancelled before its final output aborts its request, so its blocks and
  state slot come back.
- Every accepted request gets exactly one final `Delta` (finish_reason set), also on shutdown ("abort")
  and when a step raises ("error").
- A request submitted with ``ready=False`` (its images are being encoded) waits in the scheduler holding
  nothing until ``provide_images``; requests behind it keep running (the readiness gate).
- An engine of a data-parallel group (``engine.vote`` set) steps in lockstep with the other ranks: it steps
  while any rank has work, and leaves the loop only when every rank is stopping with none
  (services/engine/parallel/served_rank.py; the loop: services/engine/parallel/lockstep_loop.py). Any
  failure in a step or vote breaks the group for good: ``group_failure`` says why, every live request ends
  with "error" and new ones are refused.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from observability import tracing
from services.engine.engine import Engine
from services.engine.finish_reason import FinishReason
from services.engine.outputs import RequestOutput
from services.engine.prefix.kv_events import KvEvents
from services.engine.reporting.observer import EngineObserver, RequestTimes
from services.engine.request_checks import check_priority
from services.engine.sampling_params import SamplingParams
from services.engine.stats import EngineStats

log = logging.getLogger("shinkai.engine")

DEFAULT_MAX_QUEUED = 1024


class QueueFull(Exception):
    """More requests are unfinished than the service accepts; retry after `retry_after_s`."""

    def __init__(self, num_unfinished: int, retry_after_s: int = 1) -> None:
        super().__init__(f"the engine queue is full ({num_unfinished} requests unfinished); retry later")
        self.retry_after_s = retry_after_s


class ShuttingDown(Exception):
    """The service is draining and takes no new requests."""


@dataclass
class Delta:
    """What one request gained in one step."""

    # Tokens new since the previous delta.
    token_ids: list[int]
    # Logprob of each new token under the processed distribution (empty when the worker sampled none).
    logprobs: list[float]
    # Top-n (token id, logprob) pairs per new token, when the request asked for logprobs.
    top_logprobs: list[list[tuple[int, float]]] | None
    # Output tokens so far, these included.
    num_output_tokens: int
    # Set on the request's last delta only.
    finish_reason: FinishReason | None = None
    # The end or stop token that ended the request, if one did.
    stop_token_id: int | None = None
    # Which of the request's n choices gained (0 to n - 1); each choice's last delta has its finish_reason.
    index: int = 0
    # Set on the request's very last delta (its last unfinished choice's final one).
    last: bool = False
    # On a choice's first delta, when the request asked for prompt_logprobs: per prompt token after the first,
    # its logprob under the raw model (RequestOutput.prompt_logprobs); None otherwise.
    prompt_logprobs: list[float] | None = None
    # Alongside prompt_logprobs: per such token, the top-n (token id, logprob) pairs at its position.
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Alongside prompt_logprobs: per such token, its rank (vLLM's: how many tokens have a logprob >= its).
    prompt_ranks: list[int] | None = None
    # Prompt tokens taken from the prefix cache instead of computed (usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0


class RequestStream:
    """One request's deltas, ending with the final one. ``close()`` before the end aborts the request."""

    def __init__(
        self,
        service: EngineService,
        request_id: str,
        client_request_id: str,
        loop: asyncio.AbstractEventLoop,
        times: RequestTimes,
        num_prompt_tokens: int = 0,
        num_choices: int = 1,
    ) -> None:
        self.service = service
        self.times = times  # phase boundaries, written by the step thread only
        self.request_id = request_id  # unique among the live requests; the scheduler's id for it
        self.client_request_id = client_request_id  # the client's id; may repeat across live requests
        self.num_prompt_tokens = num_prompt_tokens  # the prompt as queued (each image's span expanded)
        self.loop = loop
        self.deltas: asyncio.Queue[Delta] = asyncio.Queue()
        # Output tokens already delivered as deltas (written by the step thread under the service lock): in all,
        # and per choice.
        self.num_sent = 0
        self.num_sent_by_choice = [0] * num_choices
        # Whether each choice's prompt logprobs were delivered (they ride on its first delta with them).
        self.prompt_logprobs_sent = [False] * num_choices
        self.num_unfinished_choices = num_choices
        # The final delta was queued; no abort is needed any more.
        self.finished = False
        # The final delta was read.
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        delta = await self.deltas.get()
        self._done = delta.last
        return delta

    def close(self) -> None:
        """Aborts the request unless its final delta was already queued. Idempotent."""
        if not self.finished:
            self.service.abort_request(self.request_id)


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    ready: bool = True  # False: waits for its images (`_Images`)
    priority: int = 0  # lower is served first (Engine.add_request)
    tenant: str = ""  # who the request is served for: the queue is fair across tenants (Engine.add_request)


@dataclass
class _Images:
    request_id: str
    rows: object  # torch.Tensor [P, D]: the embeddings of the prompt's P image positions, in order


@dataclass
class _Abort:
    request_ids: list[str] = field(default_factory=list)


class EngineService:
    def __init__(
        self,
        engine: Engine,
        *,
        replica: str = "engine-0",
        max_queued: int = DEFAULT_MAX_QUEUED,
        idle_wait_s: float = 0.05,
        observer: EngineObserver | None = None,
    ) -> None:
        self.engine = engine
        # Phase times, metrics and spans; its `metrics` may be set until start().
        self.observer = observer or EngineObserver()
        self.replica = replica  # this engine instance's name in loads, load reports and metrics
        # Unfinished requests (queued, waiting or running) above which `generate` raises QueueFull.
        self.max_queued = max_queued
        self._idle_wait_s = idle_wait_s
        self._commands: queue.Queue[_Add | _Images | _Abort] = queue.Queue()
        self._wake = threading.Event()
        # request id -> stream; written under _lock by both threads.
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()
        # The engine's stats as of the end of the step thread's latest iteration: readers on the event loop
        # never wait for a step (the reference is swapped whole, so a read is never torn).
        self._snapshot = engine.stats()
        self._kv_events = KvEvents()  # the prefix cache's changes since the last take_kv_events (under _lock)
        self._stop = threading.Event()
        self._accepting = True
        self._thread: threading.Thread | None = None
        self._vote = engine.vote  # the data-parallel group's vote (lockstep); None for one process
        self.group_failure: str | None = None  # why this rank's data-parallel group broke; None while whole
        self.num_steps = 0
        self.num_step_errors = 0

    # ---- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"{self.replica}-steps", daemon=True)
        self._thread.start()

    async def drain(self, timeout_s: float) -> bool:
        """Takes no new requests and waits up to ``timeout_s`` for the live ones; True if all finished."""
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.num_unfinished() and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return self.num_unfinished() == 0

    def stop(self) -> None:
        """Aborts whatever is left and joins the step thread."""
        self._accepting = False
        with self._lock:
            ids = list(self._streams)
        self._send(_Abort(ids))
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- requests ---------------------------------------------------------------------------

    def num_unfinished(self) -> int:
        with self._lock:
            return len(self._streams)

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError naming what is wrong. Reads only the engine's fixed configuration."""
        self.engine.validate(prompt_token_ids, params)

    def submit(
        self,
        request_id: str,
        client_request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        ready: bool = True,
        priority: int = 0,
        tenant: str = "",
    ) -> RequestStream:
        """Validates and queues a request; raises ValueError (also for a ``request_id`` already live),
        QueueFull or ShuttingDown with nothing queued. Call from the event loop that will read the stream.
        ``ready=False``: the request waits for ``provide_images`` (or ends when its stream is closed)."""
        self.validate(prompt_token_ids, params)
        check_priority(priority)
        if self.group_failure is not None:
            raise ShuttingDown(f"this engine's data-parallel group is lost: {self.group_failure}")
        if not self._accepting:
            raise ShuttingDown("the engine is shutting down")
        with self._lock:
            if len(self._streams) >= self.max_queued:
                raise QueueFull(len(self._streams))
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            stream = RequestStream(
                self,
                request_id,
                client_request_id,
                asyncio.get_running_loop(),
                self.observer.submitted(),
                len(prompt_token_ids),
                params.n,
            )
            self._streams[request_id] = stream
        self._send(_Add(request_id, list(prompt_token_ids), params, ready, priority, tenant))
        return stream

    def provide_images(self, request_id: str, rows) -> None:
        """The image embeddings [P, D] of a request submitted with ``ready=False``; it becomes schedulable.
        A request aborted meanwhile ignores them."""
        self._send(_Images(request_id, rows))

    def abort(self, client_request_id: str) -> bool:
        """Aborts every live request with this client id; False when there is none (idempotent)."""
        with self._lock:
            ids = [
                request_id
                for request_id, s in self._streams.items()
                if s.client_request_id == client_request_id and not s.finished
            ]
        if ids:
            self._send(_Abort(ids))
        return bool(ids)

    def abort_request(self, request_id: str) -> None:
        """Aborts one live request by its request id (its stream closed before its final delta); idempotent."""
        self._send(_Abort([request_id]))

    def stats(self) -> EngineStats:
        """The engine's pool and queue counts after the latest step (never waits for one)."""
        return dataclasses.replace(self._snapshot, num_queued=self._commands.qsize())

    def take_kv_events(self) -> KvEvents:
        """The prefix cache's net changes since the last call, as of the latest step (any thread; never waits)."""
        with self._lock:
            events, self._kv_events = self._kv_events, KvEvents()
        return events

    # ---- the step thread --------------------------------------------------------------------

    def _send(self, command: _Add | _Images | _Abort) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        if self._vote is not None:
            self._run_lockstep()
            return
        while not self._stop.is_set() or not self._commands.empty():
            self._apply_commands()
            busy = self.engine.has_unfinished()
            if busy:
                self._step()
            self._publish()
            if not busy:
                self._wait()
        while self.engine.has_unfinished():  # shutdown: nothing may stay in the pools
            self._step()
        self._publish()

    def _wait(self) -> None:
        self._wake.wait(self._idle_wait_s)
        self._wake.clear()

    def _run_lockstep(self) -> None:
        from services.engine.parallel.lockstep_loop import LockstepLoop, ServiceSteps

        LockstepLoop(
            self.engine,
            self._vote,
            ServiceSteps(
                apply_commands=self._apply_commands,
                step=self._step,
                publish=self._publish,
                wait=self._wait,
                stopping=self._stopping,
                lose=self._lose_group,
                end_all=self._end_all,
            ),
        ).run()

    def _publish(self) -> None:
        """After a step: the counts `stats` gives, and the prefix cache's changes `take_kv_events` gives."""
        self._snapshot = self.engine.stats()
        if self.engine.prefix_cache_enabled:
            events = self.engine.take_kv_events()
            with self._lock:
                self._kv_events = self._kv_events.then(events)

    def _stopping(self) -> bool:
        return self._stop.is_set() and self._commands.empty()

    def _lose_group(self, why: str) -> None:
        self.group_failure = why
        self._end_all(why)

    def _end_all(self, why: str) -> None:
        """Ends every request the engine holds with "error" and gives back its blocks and state slot."""
        for request_id in self.engine.end_all():  # n > 1: the streams are the requests', not their choices'
            self._deliver_final(request_id, FinishReason.ERROR, None, why)

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                try:
                    self.engine.add_request(
                        command.request_id,
                        command.prompt_token_ids,
                        command.params,
                        ready=command.ready,
                        priority=command.priority,
                        tenant=command.tenant,
                    )
                except Exception as err:  # validated already; a failure here is a bug, not bad input
                    log.exception("add_request %s failed", command.request_id)
                    self._deliver_final(command.request_id, FinishReason.ERROR, None, str(err))
            elif isinstance(command, _Images):
                if not self.engine.is_live(command.request_id):
                    continue  # aborted while its images were encoded
                try:
                    self.engine.provide_images(command.request_id, command.rows)
                except Exception as err:  # the worker refused the embeddings (e.g. the kernel backend)
                    log.exception("provide_images %s failed", command.request_id)
                    out = self.engine.abort(command.request_id)
                    if out is not None:
                        self._deliver_final(command.request_id, FinishReason.ERROR, None, str(err))
            else:
                for request_id in command.request_ids:
                    out = self.engine.abort(request_id)
                    if out is not None:
                        self._deliver(out)
                        # n > 1: the other choices ended with it; one final delta closes the stream.
                        self._deliver_final(request_id, out.finish_reason or FinishReason.ABORT, None, None)

    def _times(self, request_id: str) -> RequestTimes | None:
        stream = self._streams.get(request_id)  # one dict read: atomic; times are step-thread state
        return stream.times if stream is not None else None

    def _step(self) -> None:
        span = self.observer.step_started()
        started = time.time_ns()
        try:
            with tracing.active(span):
                outputs = self.engine.step()
        except Exception as err:
            tracing.end(span, error=type(err).__name__)
            self.num_step_errors += 1
            if self._vote is not None:
                raise  # a rank's failed step leaves its peers mid-collective: the group is lost
            log.exception("engine step failed; ending its requests with 'error'")
            self._end_all("")
            return
        self.num_steps += 1
        self.observer.step_finished(self.engine.last_plan, started, span, self._times)
        for out in outputs:
            self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
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
        self._post(stream, delta)

    def _deliver_final(self, request_id: str, reason: FinishReason, stop_token_id: int | None, why: str | None) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        stream.finished = True
        self.observer.finished(stream.times, reason, stream.num_sent)
        if why:
            log.error("request %s ended with %s: %s", request_id, reason, why)
        self._post(
            stream, Delta([], [], None, stream.num_sent, finish_reason=reason, stop_token_id=stop_token_id, last=True)
        )

    @staticmethod
    def _post(stream: RequestStream, delta: Delta) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.deltas.put_nowait, delta)
        except RuntimeError:  # the reader's event loop is closed: nobody is listening any more
            pass
