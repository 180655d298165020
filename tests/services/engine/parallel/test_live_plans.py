"""A rank's plan intake from NATS and its receiving-side load report, without processes: plans go to
``LiveLayouts.receive`` as (version, layer → layout); malformed bytes, old versions and gaps are refused
without raising; the report places a rank's slot counts in its global slot range."""

from __future__ import annotations

import asyncio

import numpy as np
import torch

from services.engine.parallel.live_plans import PlanIntake, slot_load_report
from services.eplb.layout import Layout
from services.eplb.messages import PlanMessage
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.parallel.expert_slots import ExpertSlots


class Live:
    """Stands in for LiveLayouts' intake: the versions it would take (contiguous from 1)."""

    def __init__(self) -> None:
        self.updates = []

    def receive(self, update) -> bool:
        if update.version != len(self.updates) + 1:
            return False
        self.updates.append(update)
        return True


def _plan(version: int, layer: int) -> bytes:
    layout = Layout((7, 0, 3, 5, 6, 1, 2, 4), num_gpus=2, num_logical=8)
    return PlanMessage(version, layer, 100, layout, 1.3, 1.1, 4, 4 * 18_800_640).encode()


def test_plans_reach_the_ranks_layouts_and_bad_ones_are_refused():
    live = Live()
    intake = PlanIntake(live)  # type: ignore[arg-type]
    msg = type("Msg", (), {"data": _plan(1, 3)})()
    asyncio.run(intake.on_message(msg))
    assert [(u.version, sorted(u.layouts)) for u in live.updates] == [(1, [3])]
    assert live.updates[0].layouts[3].phy2log == (7, 0, 3, 5, 6, 1, 2, 4)
    assert not intake.take(b"{not json") and not intake.take(b'{"format": 9}')
    assert not intake.take(_plan(1, 3))  # an old version
    assert intake.take(_plan(2, 0))
    assert (intake.num_taken, intake.num_refused) == (2, 3)


def test_a_ranks_report_holds_its_slot_counts_in_its_global_range():
    slots = [ExpertSlots.startup(8, 2, 2, 1) for _ in range(3)]  # 10 slots, 5 a rank; this is rank 1
    parallel = ExpertParallel(type("Exchange", (), {"world_size": 2})(), slots)  # type: ignore[arg-type]
    parallel.slot_counts += torch.arange(15).reshape(3, 5)
    report = slot_load_report(parallel, 1, 7, 2)
    assert (report.rank, report.step, report.plan_version) == (1, 7, 2)
    assert report.counts.shape == (3, 10)
    np.testing.assert_array_equal(report.counts[:, :5], 0)
    np.testing.assert_array_equal(report.counts[:, 5:], np.arange(15).reshape(3, 5))
    assert int(parallel.slot_counts.sum()) == 0  # taken
