"""An engine's pool and queue counts: what load reports, loads and the engine's gauges read."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """One engine's counts after its latest step. The field names are the keys of the NATS load report
    (services/subjects.py) and the suffixes of the `shinkai_engine_*` gauges (observability/metrics.py)."""

    free_blocks: int  # paged blocks on the free list
    total_blocks: int  # blocks that can ever be handed out (the null block 0 excluded)
    free_state_slots: int  # state slots on the free list
    total_state_slots: int  # state slots that can ever be handed out (the null slot 0 excluded)
    num_waiting: int  # requests in the scheduler's queue
    num_running: int  # requests with blocks, being stepped
    decode_step: int  # decode steps since the latest prompt step (the scheduler's vote counter)
    num_queued: int = 0  # accepted by the service, not yet handed to the scheduler (0 below a service)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache since the engine started
    prefix_cache_hits: int = 0  # of those, tokens taken from the cache instead of computed
