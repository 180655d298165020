"""The guarded planner: applies what helps, refuses what does not, and moves the fewest experts."""

import numpy as np
import pytest

from services.eplb.assignment import min_move_relabel
from services.eplb.guarded import PlanConfig, plan
from services.eplb.layout import V41_EXPERT_BYTES, Layout, count_moves, moe_lb, startup_layout
from services.eplb.policy import deepinfer_plan
from tests.services.eplb.walkthrough import FULL_RUN, GREEDY_WORSE, PASS4

GUARDED = PlanConfig(policy="guarded")
DEEPINFER = PlanConfig(policy="deepinfer")


def groups(layout: Layout) -> list[list[int]]:
    """GPU contents, ignoring GPU numbering and slot order (what moe_lb depends on)."""
    return sorted(sorted(g) for g in layout.gpu_experts())


def test_full_run_guarded_applies_a_1_05_plan_with_fewer_moves():
    start = startup_layout(5, 2, 1)
    result = plan(FULL_RUN, start, GUARDED)
    assert result.applied
    assert result.moe_lb_before == pytest.approx(1.20)
    assert result.moe_lb_after == pytest.approx(1.05)
    # DeepInfer's groups, or one swap of e1 and e3 from the start-up layout: both give 105 / 105.
    assert groups(result.layout) in ([[0, 1, 3], [0, 2, 4]], [[0, 1, 4], [0, 2, 3]])
    # DeepInfer writes slots in placement order and moves 4; relabelled, the same plan moves 2.
    assert plan(FULL_RUN, start, DEEPINFER).moves == 4
    assert result.moves == 2
    assert result.bytes_moved == 2 * V41_EXPERT_BYTES


def test_greedy_worse_deepinfer_applies_1_114():
    result = plan(GREEDY_WORSE, startup_layout(5, 2, 1), DEEPINFER)
    assert result.applied
    assert result.layout.gpu_experts() == [[3, 1, 0], [2, 4, 0]]
    assert result.moe_lb_after == pytest.approx(372 / 334)


def test_greedy_worse_guarded_does_not_apply_deepinfers_plan():
    start = startup_layout(5, 2, 1)
    deepinfer = deepinfer_plan(GREEDY_WORSE, 2, 6)
    result = plan(GREEDY_WORSE, start, GUARDED)
    assert groups(result.layout) != groups(deepinfer)
    assert result.moe_lb_after <= result.moe_lb_before


def test_greedy_worse_guard_rejects_when_only_the_policy_is_tried():
    # Without local search the candidates are the (spread) policy output and the current layout; neither
    # beats 1.057 by the threshold, so nothing moves.
    result = plan(GREEDY_WORSE, startup_layout(5, 2, 1), PlanConfig(local_search=False))
    assert not result.applied
    assert result.moves == 0 and result.bytes_moved == 0
    assert result.layout == startup_layout(5, 2, 1)
    assert result.moe_lb_after == pytest.approx(353 / 334)


def test_greedy_worse_local_search_finds_a_real_improvement():
    # Re-pointing the spare copy from e0 to e1 gives {e0, e1, e2} / {e3, e4, e1}: 349 / 334 = 1.045.
    result = plan(GREEDY_WORSE, startup_layout(5, 2, 1), GUARDED)
    assert result.applied
    assert result.moe_lb_after == pytest.approx(349 / 334)
    assert result.moves == 1


def test_threshold_blocks_a_small_gain():
    result = plan(GREEDY_WORSE, startup_layout(5, 2, 1), PlanConfig(threshold=0.05))
    assert not result.applied and "below 0.05" in result.reason


def test_held_out_window_can_veto():
    # The window says "plan for FULL_RUN", a held-out window where every expert is equally busy says the
    # start-up layout is already better there; the guard must refuse.
    holdout = np.array([[10, 10, 10, 10, 10]] * 3)
    start = startup_layout(5, 2, 1)
    result = plan(FULL_RUN, start, GUARDED, holdout=holdout)
    assert result.holdout_before is not None and result.holdout_candidate is not None
    assert result.holdout_candidate > result.holdout_before - GUARDED.threshold
    assert not result.applied and "held-out" in result.reason
    assert plan(FULL_RUN, start, GUARDED, holdout=FULL_RUN).applied


def test_pass4_guarded_spreads_copies_and_matches_deepinfer():
    start = startup_layout(4, 2, 2)
    result = plan(PASS4, start, GUARDED)
    assert result.moe_lb_after <= moe_lb(PASS4, deepinfer_plan(PASS4, 2, 6)) + 1e-12
    counts = result.layout.counts_per_gpu()
    assert counts.max() == 2  # e3's 3 copies on 2 GPUs: 2 + 1, never 3 + 0


def test_min_move_relabel_keeps_groups_and_cuts_moves():
    current = startup_layout(5, 2, 1)
    candidate = Layout((3, 4, 1, 2, 0, 0), 2, 5)  # GPU0 {3, 4, 1}, GPU1 {2, 0, 0}
    relabelled = min_move_relabel(candidate, current)
    assert groups(relabelled) == groups(candidate)
    # Best: GPU0 keeps {0, 1, 2} ∩ {2, 0, 0} = {0, 2}, GPU1 keeps {3, 4, 0} ∩ {3, 4, 1} = {3, 4}: 2 moves.
    assert count_moves(current, relabelled) == 2
    assert relabelled.gpu_experts() == [[0, 0, 2], [3, 4, 1]]


def test_deepinfer_plans_from_scratch_whatever_the_current_layout():
    a = plan(FULL_RUN, startup_layout(5, 2, 1), DEEPINFER).layout
    b = plan(FULL_RUN, Layout((4, 3, 2, 1, 0, 1), 2, 5), DEEPINFER).layout
    assert a == b


def test_config_rejects_unknown_policy():
    with pytest.raises(ValueError, match="policy"):
        PlanConfig(policy="random")


def test_plan_validated_refits_on_the_whole_window_after_the_held_out_check():
    from services.eplb.guarded import plan_validated

    start = startup_layout(5, 2, 1)
    window = np.concatenate([np.repeat(FULL_RUN, 3, axis=0), FULL_RUN])
    result = plan_validated(window, start, GUARDED, holdout_steps=2)
    assert result.applied and result.holdout_before == pytest.approx(1.2)
    assert result.layout == plan(window, start, GUARDED).layout
    # Held-out steps where the start-up layout is already balanced veto the re-plan.
    flat = np.full((2, 5), 10)
    vetoed = plan_validated(np.concatenate([np.repeat(FULL_RUN, 3, axis=0), flat]), start, GUARDED, 2)
    assert not vetoed.applied and vetoed.layout == start and "held-out" in vetoed.reason
    # DeepInfer mode plans once from everything.
    assert plan_validated(window, start, DEEPINFER, 2) == plan(window, start, DEEPINFER)
