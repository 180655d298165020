"""What entered and left an engine's prefix cache since it was last asked: the payload of a KV-event message
(`subjects.KV_EVENTS`), taken by `Engine.take_kv_events` and published by
`services/engine/reporting/kv_events_publisher.py`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KvEvents:
    stored: list[int]  # hashes of the full blocks that entered the cache (services/engine/prefix/block_hash.py)
    removed: list[int]  # hashes of the blocks evicted from it
    cleared: bool  # the whole cache was dropped before ``stored`` and ``removed``: everything earlier is gone
