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
from services.engine.delta import Delta as Delta  # re-exported: the APIs read a stream's deltas by this name
from services.engine.engine import Engine
from services.engine.finish_reason import FinishReason
from services.engine.prefix.kv_events import KvEvents
from services.engine.reporting.observer import EngineObserver
from services.engine.request_checks import check_priority
from services.engine.request_stream import RequestStream
from services.engine.sampling_params import SamplingParams
from services.engine.stats import EngineStats
from services.engine.stream_table import QueueFull as QueueFull  # re-exported: what the APIs answer with 429
from services.engine.stream_table import StreamTable

log = logging.getLogger("shinkai.engine")

DEFAULT_MAX_QUEUED = 1024


class ShuttingDown(Exception):
    """The service is draining and takes no new requests."""


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
        self._streams = StreamTable(self.observer, self.abort_request)  # the live requests' streams
        self._kv_lock = threading.Lock()  # guards _kv_events (read on any thread, written by the step thread)
        # The engine's stats as of the end of the step thread's latest iteration: readers on the event loop
        # never wait for a step (the reference is swapped whole, so a read is never torn).
        self._snapshot = engine.stats()
        self._kv_events = KvEvents()  # the prefix cache's changes since the last take_kv_events (under _kv_lock)
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
        self._send(_Abort(self._streams.request_ids()))
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ---- requests ---------------------------------------------------------------------------

    def num_unfinished(self) -> int:
        return self._streams.num_live()

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
        stream = self._streams.open(request_id, client_request_id, len(prompt_token_ids), params.n, self.max_queued)
        self._send(_Add(request_id, list(prompt_token_ids), params, ready, priority, tenant))
        return stream

    def provide_images(self, request_id: str, rows) -> None:
        """The image embeddings [P, D] of a request submitted with ``ready=False``; it becomes schedulable.
        A request aborted meanwhile ignores them."""
        self._send(_Images(request_id, rows))

    def abort(self, client_request_id: str) -> bool:
        """Aborts every live request with this client id; False when there is none (idempotent)."""
        ids = self._streams.request_ids(client_request_id)
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
        with self._kv_lock:
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
            with self._kv_lock:
                self._kv_events = self._kv_events.then(events)

    def _stopping(self) -> bool:
        return self._stop.is_set() and self._commands.empty()

    def _lose_group(self, why: str) -> None:
        self.group_failure = why
        self._end_all(why)

    def _end_all(self, why: str) -> None:
        """Ends every request the engine holds with "error" and gives back its blocks and state slot."""
        for request_id in self.engine.end_all():  # n > 1: the streams are the requests', not their choices'
            self._streams.deliver_final(request_id, FinishReason.ERROR, None, why)

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
                    self._streams.deliver_final(command.request_id, FinishReason.ERROR, None, str(err))
            elif isinstance(command, _Images):
                if not self.engine.is_live(command.request_id):
                    continue  # aborted while its images were encoded
                try:
                    self.engine.provide_images(command.request_id, command.rows)
                except Exception as err:  # the worker refused the embeddings (e.g. the kernel backend)
                    log.exception("provide_images %s failed", command.request_id)
                    out = self.engine.abort(command.request_id)
                    if out is not None:
                        self._streams.deliver_final(command.request_id, FinishReason.ERROR, None, str(err))
            else:
                for request_id in command.request_ids:
                    out = self.engine.abort(request_id)
                    if out is not None:
                        self._streams.deliver(out)
                        # n > 1: the other choices ended with it; one final delta closes the stream.
                        self._streams.deliver_final(request_id, out.finish_reason or FinishReason.ABORT, None, None)

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
        self.observer.step_finished(self.engine.last_plan, started, span, self._streams.times)
        for out in outputs:
            self._streams.deliver(out)
