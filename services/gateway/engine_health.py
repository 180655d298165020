"""The gateway's view of its dependencies' health: every ``interval_s`` it asks each engine's and the
tokenizer's grpc.health.v1 (deadline ``interval_s``) and marks the router's states, so a dead engine, or one
whose worker is gone (it answers NOT_SERVING), gets no new requests even when NATS is down too.

Invariants:
- The gateway's own health is SERVING only while the tokenizer is and at least one engine is both healthy
  here and accepting by its lifecycle events; otherwise ``on_change`` is told why (/health 503 names it).
- A NOT_SERVING answer or a refused connection counts at once; a check that merely ran out of time counts
  only after ``max_slow`` in a row, so a busy service on a loaded machine does not flap.
- With no engine serving, the problem names each engine that is still starting and its phase (the startup state in
  its Check's trailing metadata, services/worker/startup.py): "no engine is reachable and serving (engine-0:
  capturing 3/11 (32 rows) 40 s)".
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.router import EngineRouter
from services.worker.startup import METADATA_KEY, StartupState

log = logging.getLogger("shinkai.gateway.health")

NO_ENGINE = "no engine is reachable and serving"
NO_TOKENIZER = "the tokenizer is not reachable and serving"
TOKENIZER = "(tokenizer)"  # its key among the engines' names (parenthesised: never an engine's name)


async def first_serving(engines: Sequence[Any], interval_s: float = 0.05) -> Any:
    """The first of ``engines`` (each with a gRPC ``channel``) whose grpc.health.v1 answers SERVING, asking each
    every ``interval_s`` for as long as it takes: a gateway started beside its engines waits here for one to have
    loaded before it reads the model from it."""
    stubs = [health_pb2_grpc.HealthStub(engine.channel) for engine in engines]
    while True:
        for engine, stub in zip(engines, stubs):
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=max(interval_s, 1.0))
            except grpc.aio.AioRpcError:
                continue  # not listening yet, or busy starting
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return engine
        await asyncio.sleep(interval_s)


class EngineHealth:
    def __init__(
        self,
        router: EngineRouter,
        on_change: Callable[[str | None], Awaitable[None]],
        interval_s: float = 0.5,
        tokenizer_channel: Any = None,
        max_slow: int = 3,
    ) -> None:
        self.router = router
        self.on_change = on_change  # awaited with the problem (None: fine again) whenever it changes
        self.interval_s = interval_s
        self.max_slow = max_slow  # consecutive timed-out checks that count as "not serving"
        self.problem: str | None = None
        self._stubs = {name: health_pb2_grpc.HealthStub(s.engine.channel) for name, s in router.states.items()}
        if tokenizer_channel is not None:
            self._stubs[TOKENIZER] = health_pb2_grpc.HealthStub(tokenizer_channel)
        self._slow = dict.fromkeys(self._stubs, 0)
        self.healthy = dict.fromkeys(self._stubs, True)
        self.num_polls = 0  # rounds done; the first (at the gateway's start) finds what is still starting: not logged
        self.starting: dict[str, StartupState] = {}  # engines still starting, as their last answer said

    async def _check(self, name: str) -> bool:
        self.starting.pop(name, None)
        try:
            call = self._stubs[name].Check(health_pb2.HealthCheckRequest(service=""), timeout=self.interval_s)
            reply = await call
            for key, value in await call.trailing_metadata() or ():
                if key == METADATA_KEY:
                    self.starting[name] = StartupState.from_json(value)
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._slow[name] += 1
                return self._slow[name] < self.max_slow and self.healthy[name]
            return False
        self._slow[name] = 0
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def poll(self) -> str | None:
        """One round: marks every engine, tells ``on_change`` if the verdict changed; returns the problem."""
        names = list(self._stubs)
        results = await asyncio.gather(*(self._check(n) for n in names))
        for name, ok in zip(names, results):
            if self.healthy[name] != ok and self.num_polls:
                log.warning("%s is %s", name, "healthy again" if ok else "not serving")
            self.healthy[name] = ok
            state = self.router.states.get(name)
            if state is None:
                continue
            state.healthy = ok
            if ok:  # SERVING means taking requests (engines close intake before announcing "draining"), so a
                state.accepting = True  # lifecycle "up" lost while NATS was away cannot shut it out for good
        self.num_polls += 1
        serving = any(s.healthy and s.accepting for s in self.router.states.values())
        problem = NO_TOKENIZER if not self.healthy.get(TOKENIZER, True) else None if serving else NO_ENGINE
        if problem == NO_ENGINE and self.starting:
            problem += f" ({', '.join(f'{n}: {s.describe()}' for n, s in sorted(self.starting.items()))})"
        if problem != self.problem:
            self.problem = problem
            await self.on_change(problem)
        return problem

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)
