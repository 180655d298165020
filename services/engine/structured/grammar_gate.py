"""The readiness gate's grammar side: constrained requests wait in the scheduler, unschedulable and holding
nothing, until their grammar has compiled (and, with images, until those have arrived too).

The engine polls ``GrammarGate.poll`` at the top of each step: requests whose compile finished come back ready
(their compiled grammar with them), those whose compile failed or ran past the timeout come back refused with
the reason. Requests behind them in the queue are scheduled meanwhile.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass


@dataclass
class _Pending:
    future: Future  # the compiled grammar's (GrammarCompiler.compile)
    deadline: float  # time.monotonic() past which the compile is refused
    images_pending: bool  # the request also waits for its images (Engine.provide_images)


@dataclass(frozen=True)
class GateResult:
    # (scheduler request id, compiled grammar, whether its images have arrived): the grammar is ready.
    ready: list[tuple[str, object, bool]]
    # (scheduler request id, why): the compile failed or took too long; the request ends with an error.
    refused: list[tuple[str, str]]


class GrammarGate:
    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._pending: dict[str, _Pending] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._pending

    def __bool__(self) -> bool:
        return bool(self._pending)

    def hold(self, request_id: str, future: Future, images_pending: bool) -> None:
        self._pending[request_id] = _Pending(future, time.monotonic() + self.timeout_s, images_pending)

    def images_arrived(self, request_id: str) -> None:
        self._pending[request_id].images_pending = False

    def drop(self, request_id: str) -> None:
        self._pending.pop(request_id, None)

    def poll(self) -> GateResult:
        now = time.monotonic()
        ready, refused = [], []
        for request_id, pending in list(self._pending.items()):
            if pending.future.cancelled():
                del self._pending[request_id]
                refused.append((request_id, "the grammar's compile was cancelled"))
            elif pending.future.done():
                del self._pending[request_id]
                error = pending.future.exception()
                if error is None:
                    ready.append((request_id, pending.future.result(), not pending.images_pending))
                else:
                    refused.append((request_id, f"the grammar failed to compile: {error}"))
            elif now > pending.deadline:
                del self._pending[request_id]
                refused.append((request_id, f"the grammar took over {self.timeout_s:g} s to compile"))
        return GateResult(ready, refused)

    def wait(self, timeout_s: float) -> None:
        """Waits until some pending compile finishes (or ``timeout_s``): an engine with nothing else to run
        sleeps here rather than spinning on empty steps."""
        if self._pending:
            wait_futures([p.future for p in self._pending.values()], timeout=timeout_s, return_when="FIRST_COMPLETED")
