"""NATS subject names, defined once for the whole project.

NATS carries events and control, never token streams. Each service adds its subjects here, with the
publisher, the subscribers and where the message format is defined, so no subject is spelt twice.
"""

from __future__ import annotations

# Engines → EPLB planner. One message per engine rank per step: tokens that reached each physical expert
# slot in every MoE layer, in the compact binary format of `services/eplb/messages.py` (versioned header).
EXPERT_LOAD = "shinkai.eplb.load"

# EPLB planner → engines. One message per applied layer plan: JSON with a monotonic `version`, the layer,
# the logical↔physical maps, moe_lb before/after and the moves (`services/eplb/messages.py`).
EXPERT_PLAN = "shinkai.eplb.plan"

# Engines → gateways (routing) and anyone watching. One JSON message per engine every report interval and
# after a request ends: {"replica", "address", each field of `EngineStats` (services/engine/stats.py: the pool
# and queue counts), "time"} (`services/engine/reporting/reporter.py`).
ENGINE_LOAD = "shinkai.engine.load"

# Engines → anyone watching. JSON {"replica", "address", "state": "up" | "unhealthy" | "draining" | "down",
# "time"} when an engine becomes ready (or its lost worker is back), loses its worker, starts draining, and
# has stopped (`services/engine/reporting/reporter.py`, `services/entrypoints/engine.py`). Only "up" takes requests.
ENGINE_LIFECYCLE = "shinkai.engine.lifecycle"
