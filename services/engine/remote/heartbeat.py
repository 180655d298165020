"""The engine's heartbeat on its worker process: a thread that asks the worker's grpc.health.v1 every
``interval_s``, each check with a deadline of half ``timeout_s``.

Invariants:
- The worker counts as gone only on evidence: a check has failed since its latest SERVING answer, and that
  answer is over ``timeout_s`` old. A worker that died holding a step (killed, or hung: SIGSTOP, a wedged
  device) fails its checks, so the step in flight is abandoned within ``timeout_s`` plus one check's
  deadline, not after the step's own (long) gRPC deadline.
- A heartbeat thread that merely did not get to run (the engine's process starved of CPU on a loaded
  machine) has failed no check, so it never declares a busy worker gone.
- ``alive`` only reads a timestamp: the step thread may ask it as often as it likes.
- ``answering_for()`` is how long every check has been answered SERVING without a miss (0 after a miss): a
  worker coming back counts as back only once it has answered steadily (``services/entrypoints/engine.py``).
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

log = logging.getLogger("shinkai.engine.heartbeat")


class WorkerHeartbeat:
    def __init__(
        self, channel: grpc.Channel, address: str, *, interval_s: float = 0.25, timeout_s: float = 1.0
    ) -> None:
        self.stub = health_pb2_grpc.HealthStub(channel)
        self.address = address
        self.interval_s = interval_s  # seconds between health checks
        self.timeout_s = timeout_s  # no SERVING answer for this long, and a check failed: the worker is gone
        self.check_timeout_s = max(interval_s, timeout_s / 2)  # each check's deadline
        self._last_ok = time.monotonic()  # the latest SERVING answer (-inf: a call found the worker gone)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_missed = 0  # checks that got no SERVING answer, ever
        self._answering_since: float | None = None  # the first SERVING answer since the latest miss (None: missed)
        self._missed_since_ok = False  # a check failed after the latest SERVING answer

    @property
    def alive(self) -> bool:
        if self._thread is None:  # not watching (yet): alive unless a call found it gone
            return self._last_ok != float("-inf")
        return not self._missed_since_ok or time.monotonic() - self._last_ok <= self.timeout_s

    def mark_lost(self) -> None:
        """The step call itself found the worker gone (connection refused or reset): dead until it answers."""
        self._last_ok = float("-inf")
        self._answering_since = None
        self._missed_since_ok = True

    def answering_for(self) -> float:
        """Seconds since the current unbroken run of SERVING answers began; 0 while the latest check missed."""
        since = self._answering_since
        return 0.0 if since is None or not self.alive else time.monotonic() - since

    def beat(self) -> bool:
        """One health check; True when the worker answered SERVING."""
        try:
            reply = self.stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.check_timeout_s)
        except grpc.RpcError:
            return self._missed()
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            return self._missed()
        self._last_ok = time.monotonic()
        self._missed_since_ok = False
        if self._answering_since is None:
            self._answering_since = self._last_ok
        return True

    def _missed(self) -> bool:
        self.num_missed += 1
        self._answering_since = None
        self._missed_since_ok = True
        return False

    def start(self) -> None:
        """Starts watching (idempotent); the worker counts as alive from now until it misses ``timeout_s``."""
        if self._thread is not None:
            return
        self._last_ok = self._answering_since = time.monotonic()
        self._missed_since_ok = False
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{self.address}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        was_alive = True
        while not self._stop.is_set():
            started = time.monotonic()
            self.beat()
            if self.alive != was_alive:
                was_alive = self.alive
                log.warning("worker %s is %s", self.address, "back" if was_alive else "gone (no heartbeat)")
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
