"""NATS subject names, defined once for the whole project.

NATS carries events and control, never token streams. Each service adds its subjects here, with the
publisher, the subscribers and where the message format is defined, so no subject is spelt twice.

What an engine publishes goes to a subject of its own: the family's name and the engine's replica name as the
last token (`of_replica`), so per-service NATS users (services/nats_auth.py) can let an engine publish only its
own subjects, and a subscriber takes the replica from the subject, never from the message alone (`replica_of`).
"""

from __future__ import annotations

# Engines → EPLB planner. One message per engine rank per step: tokens that reached each physical expert
# slot in every MoE layer, in the compact binary format of `services/eplb/messages.py` (versioned header).
EXPERT_LOAD = "shinkai.eplb.load"  # a family: each engine publishes on of_replica(EXPERT_LOAD, replica)

# EPLB planner → engines. One message per applied layer plan: JSON with a monotonic `version`, the layer,
# the logical↔physical maps, moe_lb before/after and the moves (`services/eplb/messages.py`).
EXPERT_PLAN = "shinkai.eplb.plan"

# Engines → gateways (routing) and anyone watching. One JSON message per engine every report interval and
# after a request ends: {"replica", "address", each field of `EngineStats` (services/engine/stats.py: the pool
# and queue counts), "time"} (`services/engine/reporting/reporter.py`).
ENGINE_LOAD = "shinkai.engine.load"  # a family: of_replica(ENGINE_LOAD, replica)

# Engines → anyone watching. JSON {"replica", "address", "state": "up" | "unhealthy" | "draining" | "down",
# "time"} when an engine becomes ready (or its lost worker is back), loses its worker, starts draining, and
# has stopped (`services/engine/reporting/reporter.py`, `services/entrypoints/engine.py`). Only "up" takes requests.
ENGINE_LIFECYCLE = "shinkai.engine.lifecycle"  # a family: of_replica(ENGINE_LIFECYCLE, replica)

# Engines → gateways (cache-aware routing). JSON {"replica", "stored": [block hash, ...], "removed": [...],
# "cleared": bool, "time"}, batched per report interval: full blocks that entered or left the engine's prefix
# cache (hashes: services/engine/prefix/block_hash.py); "cleared" says the engine dropped its whole cache, so
# a subscriber forgets everything it held for that replica, then applies "removed", then "stored"
# (services/engine/reporting/kv_events_publisher.py; the subscriber: services/gateway/router.py).
KV_EVENTS = "shinkai.engine.kv"  # a family: of_replica(KV_EVENTS, replica)

# Families whose subjects each end in the publishing engine's replica name.
REPLICA_FAMILIES = (EXPERT_LOAD, ENGINE_LOAD, ENGINE_LIFECYCLE, KV_EVENTS)
_NOT_IN_A_TOKEN = frozenset(".*> \t\r\n")


def check_replica(replica: str) -> str:
    """``replica`` if it can be one NATS subject token (no dots, wildcards or white space); ValueError otherwise."""
    if not replica or any(c in _NOT_IN_A_TOKEN for c in replica):
        raise ValueError(f"replica name {replica!r} must be one NATS subject token: no '.', '*', '>' or white space")
    return replica


def of_replica(family: str, replica: str) -> str:
    """The subject on which engine ``replica`` publishes messages of ``family``."""
    return f"{family}.{check_replica(replica)}"


def every_replica(family: str) -> str:
    """The wildcard subject that subscribes to ``family`` from every engine."""
    return f"{family}.*"


def replica_of(family: str, subject: str) -> str | None:
    """The replica that published on ``subject`` of ``family``; None when the subject is not one of its."""
    prefix = family + "."
    replica = subject[len(prefix) :] if subject.startswith(prefix) else ""
    return replica if replica and not any(c in _NOT_IN_A_TOKEN for c in replica) else None
