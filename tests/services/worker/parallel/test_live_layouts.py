"""LiveLayouts' versions without processes: received in order from 1, an old version or one after a gap
refused (and nothing after a gap), a layout of another shape refused on receipt with its version used up;
a boundary starts only versions every rank has received and puts in force only those every rank staged.
The moves themselves (two gloo ranks): tests/services/engine/parallel/test_live_eplb.py."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import torch

from services.eplb.layout import Layout, startup_layout
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.parallel.expert_slots import ExpertSlots
from services.worker.parallel.live_layouts import BoundaryVote, LayoutUpdate, LiveLayouts

MOVED = Layout((7, 0, 3, 5, 6, 1, 2, 4), num_gpus=2, num_logical=8)


def _live() -> LiveLayouts:
    slots = [ExpertSlots.startup(8, 2, 0, 0) for _ in range(2)]  # 2 layers, 8 slots, this is rank 0
    parallel = ExpertParallel(SimpleNamespace(world_size=2), slots)  # type: ignore[arg-type]
    weights = (torch.zeros(4, 2, 3), torch.zeros(4, 2, 3), torch.zeros(4, 3, 2))
    moes = [SimpleNamespace(expert_weights=lambda: weights, moves_in_place=False) for _ in range(2)]
    return LiveLayouts(moes, parallel, group=None)  # type: ignore[arg-type]


def test_versions_arrive_in_order_and_a_gap_stops_the_intake(caplog):
    live = _live()
    try:
        assert live.receive(LayoutUpdate(1, {0: MOVED}))
        assert not live.receive(LayoutUpdate(1, {0: MOVED}))  # old
        with caplog.at_level(logging.ERROR):
            assert not live.receive(LayoutUpdate(3, {0: MOVED}))  # 2 was lost
        assert "version 2 was lost" in caplog.text
        assert not live.receive(LayoutUpdate(2, {0: MOVED}))  # nothing after a gap
        assert live.local() == BoundaryVote(received=1, staged=0)
    finally:
        live.close()


def test_a_layout_of_another_shape_uses_up_its_version(caplog):
    live = _live()
    try:
        with caplog.at_level(logging.ERROR):
            assert not live.receive(LayoutUpdate(1, {0: startup_layout(8, 4, 0)}))
            assert not live.receive(LayoutUpdate(2, {5: MOVED}))
        assert "layer 0's layout has 4 ranks, this group has 2" in caplog.text
        assert "layer 5 is outside this model's 2 MoE layers" in caplog.text
        assert live.receive(LayoutUpdate(3, {1: MOVED}))
        assert live.local().received == 3
    finally:
        live.close()


def test_a_boundary_starts_what_all_received_and_switches_what_all_staged():
    live = _live()
    try:
        live.receive(LayoutUpdate(1, {}))  # a refused plan: nothing to move, staged at once by the mover
        live.receive(LayoutUpdate(2, {}))
        assert live.at_boundary(BoundaryVote(received=0, staged=0)) == []  # a peer has received nothing
        live.at_boundary(BoundaryVote(received=1, staged=0))
        deadline = time.monotonic() + 10
        while live.local().staged < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live.local() == BoundaryVote(received=2, staged=1)  # version 2 was not started
        assert live.at_boundary(BoundaryVote(received=1, staged=0)) == []  # a peer has not staged 1 yet
        assert live.at_boundary(BoundaryVote(received=1, staged=1)) == [1]
        assert live.switches == [(1, 3)] and live.version == 1 and live.settled
    finally:
        live.close()
