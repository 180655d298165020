"""A rank's side of the EPLB planner's NATS traffic: plans in, per-slot counts out.

- **Plans in.** Every rank subscribes to ``subjects.EXPERT_PLAN``. NATS delivers one publisher's messages in
  order, so every rank sees the planner's versions 1, 2, 3, … in the same order and hands each to its
  ``LiveLayouts`` (services/worker/parallel/live_layouts.py), which checks it against the group (a plan for
  another number of ranks, slots or experts is refused with a log line naming the mismatch, on every rank
  alike) and moves it live. The versions every rank has received are agreed in the boundary vote, so no
  rank moves a plan a peer has not got; a lost message stops later plans (logged), never the group.
- **Counts out.** After each step a rank reports the pairs that arrived at its own physical slots (the
  receiving side's counts), placed in the layer's global slot range, with the plan version in force: the
  planner sums the ranks' reports of a step (services/eplb/planner.py), so the step's count of every slot
  is its holder's.
"""

from __future__ import annotations

import logging

import numpy as np

from services import subjects
from services.eplb.messages import LoadReport, MessageError, PlanMessage, decode_plan
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.parallel.live_layouts import LayoutUpdate, LiveLayouts

log = logging.getLogger("shinkai.engine.live_plans")


def update_from_plan(message: PlanMessage) -> LayoutUpdate:
    """A planner's layer plan as a live update (the planner's version, one layer)."""
    return LayoutUpdate(message.version, {message.layer: message.layout})


class PlanIntake:
    """Feeds the planner's plans from NATS to a rank's ``LiveLayouts``."""

    def __init__(self, live: LiveLayouts) -> None:
        self.live = live
        self.num_taken = 0  # plans accepted for moving
        self.num_refused = 0  # plans refused (malformed, old, after a gap, or of another shape)

    async def subscribe(self, nc) -> None:
        """Subscribes ``nc`` (a connected nats.aio client) to the plan subject."""
        await nc.subscribe(subjects.EXPERT_PLAN, cb=self.on_message)
        await nc.flush(timeout=5)

    async def on_message(self, msg) -> None:
        self.take(msg.data)

    def take(self, data: bytes) -> bool:
        """One plan message; True if it will be moved. Never raises on bad input."""
        try:
            message = decode_plan(data)
        except MessageError as err:
            self.num_refused += 1
            log.error("EPLB plan refused: %s", err)
            return False
        taken = self.live.receive(update_from_plan(message))
        if taken:
            self.num_taken += 1
            log.info(
                "EPLB plan v%d layer %d received: %d moves, moe_lb %.4f -> %.4f predicted",
                message.version,
                message.layer,
                message.moves,
                message.moe_lb_before,
                message.moe_lb_after,
            )
        else:
            self.num_refused += 1
        return taken


def slot_load_report(parallel: ExpertParallel, rank: int, step: int, plan_version: int) -> LoadReport:
    """Takes the slot counts since the last take: this rank's slots' arrivals per layer, in the layer's
    global slot range (zeros elsewhere), as a load report of ``step``."""
    local = parallel.take_slot_counts().cpu().numpy()  # [layers, slots per rank]
    per_rank = local.shape[1]
    counts = np.zeros((local.shape[0], per_rank * parallel.exchange.world_size), dtype=np.int64)
    counts[:, rank * per_rank : (rank + 1) * per_rank] = local
    return LoadReport(rank=rank, step=step, plan_version=plan_version, counts=counts)
