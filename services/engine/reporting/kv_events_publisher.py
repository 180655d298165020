"""An engine's prefix-cache events for the gateways' cache-aware routing (`subjects.KV_EVENTS`).

Every ``interval_s`` the publisher takes what entered and left the engine's prefix cache since the last take
(``take``: `Engine.take_kv_events`) and, when anything did, publishes one JSON message on the engine's own
subject: ``{"replica", "stored": [hash, ...], "removed": [...], "cleared": bool, "time"}``. A subscriber
applies ``cleared`` (forget the replica's blocks), then ``removed``, then ``stored``.

Publishing is best effort, like the load reports (`services/engine/reporting/reporter.py`): a batch NATS did
not take is merged into the next one. When the backlog passes ``max_pending`` hashes it is dropped and the
next message says ``cleared`` instead: subscribers then under-count this replica's blocks until they are
stored again, which costs cache hits, never correctness (routing is only a preference).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from services import subjects
from services.engine.prefix.kv_events import KvEvents

log = logging.getLogger("shinkai.engine.kv_events")
DEFAULT_MAX_PENDING = 1 << 20  # hashes held back while NATS is away (8 bytes each as ints, more as JSON)


def merged(first: KvEvents, then: KvEvents) -> KvEvents:
    """One batch that a subscriber applies to the same effect as ``first`` followed by ``then``."""
    if then.cleared:
        return KvEvents(stored=list(then.stored), removed=list(then.removed), cleared=True)
    # Applying removed-then-stored of the union keeps a hash that ``then`` stored after ``first`` removed it;
    # one that ``then`` removed after ``first`` stored it must leave ``stored``.
    gone = set(then.removed)
    return KvEvents(
        stored=[h for h in first.stored if h not in gone] + list(then.stored),
        removed=first.removed + then.removed,
        cleared=first.cleared,
    )


class KvEventsPublisher:
    def __init__(
        self,
        nc: Any,
        replica: str,
        take: Callable[[], KvEvents],
        interval_s: float = 0.25,
        max_pending: int = DEFAULT_MAX_PENDING,
    ) -> None:
        self.nc = nc  # a connected nats.aio.client.Client (the load reporter's)
        self.replica = replica  # the engine's name in every message and its subject's last token
        self.subject = subjects.of_replica(subjects.KV_EVENTS, replica)
        self.take = take  # the engine's events since its last call
        self.interval_s = interval_s  # seconds between batches
        self.max_pending = max_pending  # hashes held back for an unreachable NATS before the backlog is dropped
        self.num_published = 0  # messages NATS took
        self._pending: KvEvents | None = None  # taken, not yet published
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.publish()
            await asyncio.sleep(self.interval_s)

    async def publish(self) -> bool:
        """Takes the engine's events and publishes them with any backlog; True when a message went out."""
        try:
            events = self.take()
        except Exception as err:  # the engine's bug must not stop its reports: the next interval tries again
            log.warning("kv events not taken: %s", err or type(err).__name__)
            return False
        batch = events if self._pending is None else merged(self._pending, events)
        if not (batch.stored or batch.removed or batch.cleared):
            self._pending = None
            return False
        message = {
            "replica": self.replica,
            "stored": batch.stored,
            "removed": batch.removed,
            "cleared": batch.cleared,
            "time": time.time(),
        }
        try:
            await self.nc.publish(self.subject, json.dumps(message).encode())
        except Exception as err:  # NATS away (restarting): kept for the next interval
            log.warning("kv events not published: %s", err or type(err).__name__)
            if len(batch.stored) + len(batch.removed) > self.max_pending:
                batch = KvEvents(stored=[], removed=[], cleared=True)
            self._pending = batch
            return False
        self._pending = None
        self.num_published += 1
        return True

    async def stop(self) -> None:
        """Stops the loop; the connection is its owner's to close."""
        if self._task is not None:
            self._task.cancel()
            self._task = None
