"""What entered and left an engine's prefix cache since it was last asked: the payload of a KV-event message
(`subjects.KV_EVENTS`), taken by `Engine.take_kv_events` and published by
`services/engine/reporting/kv_events_publisher.py`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KvEvents:
    # Hashes of the full blocks that entered the cache since the last take and are in it now
    # (services/engine/prefix/block_hash.py): a block stored and evicted again in between is in neither list.
    stored: list[int]
    # Hashes of the blocks that left it since the last take; one also in ``stored`` left, then came back: held.
    removed: list[int]
    # The whole cache was dropped since the last take, before ``removed`` and ``stored``: everything earlier is gone.
    cleared: bool
