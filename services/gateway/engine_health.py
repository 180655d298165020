"""The gateway's view of its engines' health: every ``interval_s`` it asks each engine's grpc.health.v1
(deadline ``interval_s``) and marks the router's state, so a dead engine, or one whose worker is gone (it
answers NOT_SERVING), gets no new requests even when NATS is down too.

Invariant: the gateway's own health is SERVING only while at least one engine is both healthy here and
accepting by its lifecycle events; otherwise ``on_change`` is told why, and /health is 503 naming it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.gateway.router import EngineRouter

log = logging.getLogger("shinkai.gateway.health")

NO_ENGINE = "no engine is reachable and serving"


class EngineHealth:
    def __init__(self, router: EngineRouter, on_change: Callable[[str | None], Awaitable[None]],
                 interval_s: float = 0.5) -> None:
        self.router = router
        self.on_change = on_change  # awaited with the problem (None: fine again) whenever it changes
        self.interval_s = interval_s
        self.problem: str | None = None
        self._stubs = {name: health_pb2_grpc.HealthStub(s.engine.channel) for name, s in router.states.items()}

    async def _check(self, name: str) -> bool:
        try:
            reply = await self._stubs[name].Check(health_pb2.HealthCheckRequest(service=""), timeout=self.interval_s)
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def poll(self) -> str | None:
        """One round: marks every engine, tells ``on_change`` if the verdict changed; returns the problem."""
        names = list(self.router.states)
        results = await asyncio.gather(*(self._check(n) for n in names))
        for name, ok in zip(names, results):
            state = self.router.states[name]
            if state.healthy != ok:
                log.warning("engine %s is %s", name, "healthy again" if ok else "not serving")
            state.healthy = ok
            if ok:  # SERVING means taking requests (engines close intake before announcing "draining"), so a
                state.accepting = True  # lifecycle "up" lost while NATS was away cannot shut it out for good
        serving = any(s.healthy and s.accepting for s in self.router.states.values())
        problem = None if serving else NO_ENGINE
        if problem != self.problem:
            self.problem = problem
            await self.on_change(problem)
        return problem

    async def run(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)
