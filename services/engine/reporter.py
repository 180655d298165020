"""An engine's NATS reports: load (for routing) and lifecycle events. Subjects: `services.subjects`.

Load reports go out every ``interval_s`` and are JSON (`subjects.ENGINE_LOAD` says which keys). A lost
NATS connection never stops the engine: publishing is best effort, and nats-py reconnects by itself.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from services import subjects

log = logging.getLogger("shinkai.engine.reporter")


class LoadReporter:
    def __init__(self, nats_url: str, engine_id: str, address: str, stats: Callable[[], dict[str, int]],
                 interval_s: float = 0.25) -> None:
        self.nats_url = nats_url
        self.engine_id = engine_id  # the engine's name in every message
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

        self.nc = await nats.connect(self.nats_url, name=f"shinkai-{self.engine_id}", max_reconnect_attempts=-1,
                                      error_cb=on_error)
        await self.lifecycle("up")
        self._task = asyncio.create_task(self._loop())

    def load_message(self) -> dict[str, Any]:
        return {"engine_id": self.engine_id, "address": self.address, **self.stats(), "time": time.time()}

    async def _loop(self) -> None:
        while True:
            await self.publish_load()
            await asyncio.sleep(self.interval_s)

    async def publish_load(self) -> None:
        await self.nc.publish(subjects.ENGINE_LOAD, json.dumps(self.load_message()).encode())
        self.num_published += 1

    async def lifecycle(self, state: str) -> None:
        message = {"engine_id": self.engine_id, "address": self.address, "state": state, "time": time.time()}
        await self.nc.publish(subjects.ENGINE_LIFECYCLE, json.dumps(message).encode())
        await self.nc.flush()

    async def stop(self) -> None:
        """Publishes "down" and closes the connection."""
        if self._task is not None:
            self._task.cancel()
        if self.nc is not None and not self.nc.is_closed:
            await self.lifecycle("down")
            await self.nc.close()
