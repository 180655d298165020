"""The online planner's state machine and its wire formats, without NATS."""

import json

import numpy as np
import pytest

from services.eplb.guarded import PlanConfig
from services.eplb.layout import Layout, moe_lb, startup_layout
from services.eplb.messages import LoadReport, MessageError, PlanMessage, decode_load, decode_plan
from services.eplb.planner import Planner, PlannerConfig
from tests.services.eplb.walkthrough import GREEDY_WORSE


def physical_counts(layout: Layout, logical: np.ndarray) -> np.ndarray:
    """Splits each expert's tokens evenly over its copies (remainder to the first copy)."""
    counts = np.zeros(layout.num_slots, dtype=np.int64)
    for expert, slots in enumerate(layout.log2phy()):
        share, rest = divmod(int(logical[expert]), len(slots))
        counts[slots] = share
        counts[slots[0]] += rest
    return counts


HOT = np.array([100, 100, 100, 100, 100, 100, 100, 1000])  # expert 7 hot; start-up puts it with 0, 1 copies
FLAT = np.full(8, 100)


def config(**overrides) -> PlannerConfig:
    base = dict(num_logical=8, num_gpus=2, num_redundant=2, num_layers=2, num_ranks=2, interval=8, window=8)
    return PlannerConfig(**(base | overrides))


def report(planner: Planner, rank: int, step: int, version: int = 0, loads=(HOT, FLAT)) -> LoadReport:
    counts = np.stack([physical_counts(planner.layout(layer, version), loads[layer]) for layer in range(2)])
    return LoadReport(rank=rank, step=step, plan_version=version, counts=counts)


def test_load_report_round_trips_and_checks_its_header():
    counts = np.arange(24).reshape(2, 12)
    data = LoadReport(3, 2**40, 7, counts).encode()
    back = decode_load(data)
    assert (back.rank, back.step, back.plan_version) == (3, 2**40, 7)
    assert np.array_equal(back.counts, counts)
    with pytest.raises(MessageError, match="format 9"):
        decode_load(data[:4] + bytes([9]) + data[5:])
    with pytest.raises(MessageError, match="magic"):
        decode_load(b"JSON" + data[4:])
    with pytest.raises(MessageError, match="needs"):
        decode_load(data[:-4])


def test_plan_message_round_trips():
    layout = startup_layout(8, 2, 2)
    message = PlanMessage(4, 1, 100, layout, 1.3, 1.1, 3, 3 * 10)
    assert decode_plan(message.encode()) == message
    assert json.loads(message.encode())["log2phy"] == layout.log2phy()
    with pytest.raises(MessageError):
        decode_plan(b'{"format": 1, "version": 1}')


def test_first_replan_at_a_quarter_interval_then_every_interval():
    planner = Planner(config())
    due = []
    for step in range(20):
        for rank in (0, 1):
            if planner.add(report(planner, rank, step, planner.version)):
                due.append(planner.num_completed)
                planner.replan()
    assert due == [2, 10, 18]


def test_a_step_completes_only_when_every_rank_reported_once():
    planner = Planner(config(interval=4))
    assert not planner.add(report(planner, 0, 0))
    assert not planner.add(report(planner, 0, 0))  # duplicate ignored
    assert planner.num_completed == 0
    assert planner.add(report(planner, 1, 0))  # interval 4: first re-plan after 1 step
    assert planner.num_completed == 1
    assert not planner.add(report(planner, 1, 0))  # a late duplicate of a completed step


def test_replan_applies_the_hot_layer_and_rejects_the_flat_one():
    planner = Planner(config())
    for step in range(2):
        for rank in (0, 1):
            planner.add(report(planner, rank, step))
    outcome = planner.replan()
    assert [p.layer for p in outcome.plans] == [0] and outcome.plans[0].version == 1
    assert outcome.num_rejected == 1
    message = outcome.plans[0]
    window = np.stack([2 * HOT, 2 * HOT])
    assert message.moe_lb_before == pytest.approx(moe_lb(window, startup_layout(8, 2, 2)))
    assert message.moe_lb_after == pytest.approx(moe_lb(window, message.layout))
    assert message.moe_lb_after < message.moe_lb_before - 0.01
    assert planner.layout(0) == message.layout and planner.layout(0, 0) == startup_layout(8, 2, 2)


def test_counts_are_mapped_through_the_layout_the_engine_ran():
    planner = Planner(config(interval=4, window=1))
    for rank in (0, 1):
        planner.add(report(planner, rank, 0))
    new = planner.replan().plans[0].layout
    # One rank still on the start-up layout, the other on plan 1: both describe the same logical load.
    planner.add(report(planner, 0, 1, version=0))
    planner.add(report(planner, 1, 1, version=1))
    assert np.array_equal(planner._windows[0][-1], 2 * HOT)
    with pytest.raises(MessageError, match="newer"):
        planner.add(report(planner, 0, 2, version=5))
    assert new != startup_layout(8, 2, 2)


def test_reports_of_the_wrong_shape_or_rank_are_refused():
    planner = Planner(config())
    with pytest.raises(MessageError, match="expected"):
        planner.add(LoadReport(0, 0, 0, np.zeros((2, 9), dtype=np.int64)))
    with pytest.raises(MessageError, match="rank"):
        planner.add(LoadReport(5, 0, 0, np.zeros((2, 10), dtype=np.int64)))


@pytest.mark.parametrize("policy,after", [("deepinfer", 372 / 334), ("guarded", 349 / 334)])
def test_deepinfer_policy_publishes_the_worse_plan_and_guarded_does_not(policy, after):
    planner = Planner(
        PlannerConfig(
            num_logical=5,
            num_gpus=2,
            num_redundant=1,
            num_layers=1,
            interval=8,
            window=8,
            plan=PlanConfig(policy=policy),
        )
    )
    start = startup_layout(5, 2, 1)
    for step, logical in enumerate(GREEDY_WORSE):
        planner.add(LoadReport(0, step, 0, physical_counts(start, logical)[None, :]))
    (message,) = planner.replan().plans
    assert message.moe_lb_before == pytest.approx(353 / 334)
    assert message.moe_lb_after == pytest.approx(after)
