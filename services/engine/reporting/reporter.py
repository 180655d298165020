"""An engine's NATS reports: load (for routing) and lifecycle events. Subjects: `services.subjects`.

Load reports go out every ``interval_s`` and are JSON (`subjects.ENGINE_LOAD` says which keys). A lost
NATS connection never stops the engine: publishing is best effort, and nats-py reconnects by itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from services import nats_auth, subjects
from services.engine.stats import EngineStats

log = logging.getLogger("shinkai.engine.reporter")
FLUSH_TIMEOUT_S = 2.0  # the deadline of every round trip to NATS (there are no request/reply calls)


class LoadReporter:
    def __init__(
        self, nats_url: str, replica: str, address: str, stats: Callable[[], EngineStats], interval_s: float = 0.25
    ) -> None:
        self.nats_url = nats_url
        self.replica = replica  # the engine's name in every message
        self.address = address  # its gRPC address, so a gateway can reach it
        self.stats = stats  # the engine's pool and queue counts
        self.interval_s = interval_s  # seconds between load reports
        self.nc: Any = None  # nats.aio.client.Client, once started
        self._task: asyncio.Task | None = None
        self.num_published = 0

    async def start(self) -> None:
        import nats

        async def on_error(err: Exception) -> None:
            log.warning("nats: %s", err or type(err).__name__)

        self.nc = await nats.connect(
            self.nats_url,
            name=f"shinkai-{self.replica}",
            max_reconnect_attempts=-1,
            error_cb=on_error,
            connect_timeout=FLUSH_TIMEOUT_S,
            reconnect_time_wait=0.5,
            **nats_auth.connect_options(),
        )
        await self.lifecycle("up")
        self._task = asyncio.create_task(self._loop())

    def load_message(self) -> dict[str, Any]:
        return {
            "replica": self.replica,
            "address": self.address,
            **dataclasses.asdict(self.stats()),
            "time": time.time(),
        }

    async def _loop(self) -> None:
        while True:
            try:
                await self.publish_load()
            except Exception as err:  # NATS away (restarting): the next interval tries again
                log.warning("load report not published: %s", err or type(err).__name__)
            await asyncio.sleep(self.interval_s)

    async def publish_load(self) -> None:
        await self.nc.publish(
            subjects.of_replica(subjects.ENGINE_LOAD, self.replica), json.dumps(self.load_message()).encode()
        )
        self.num_published += 1

    async def lifecycle(self, state: str) -> None:
        message = {"replica": self.replica, "address": self.address, "state": state, "time": time.time()}
        try:
            await self.nc.publish(
                subjects.of_replica(subjects.ENGINE_LIFECYCLE, self.replica), json.dumps(message).encode()
            )
            await self.nc.flush(timeout=FLUSH_TIMEOUT_S)
        except Exception as err:  # best effort: a lifecycle event never blocks the engine
            log.warning("lifecycle %r not confirmed by NATS: %s", state, err or type(err).__name__)

    async def stop(self) -> None:
        """Publishes "down" and closes the connection."""
        if self._task is not None:
            self._task.cancel()
        if self.nc is not None and not self.nc.is_closed:
            await self.lifecycle("down")
            await self.nc.close()
