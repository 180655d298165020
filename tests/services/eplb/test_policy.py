"""DeepInfer's policy on the walkthrough's hand-worked cases, its rounding and start-up layout."""

import numpy as np
import pytest

from services.eplb.layout import Layout, LayoutError, gpu_loads, moe_lb, startup_layout, total_redundant
from services.eplb.policy import deepinfer_plan, num_slots_for, stage_a, stage_b
from tests.services.eplb.walkthrough import FULL_RUN, GREEDY_WORSE, PASS4


def test_rounding_ep8_keeps_416_slots():
    assert total_redundant(384, 8, 32) == 32
    assert num_slots_for(384, 8, 32) == 416


def test_rounding_ep63_pads_to_504_slots():
    assert total_redundant(384, 63, 63) == 120
    assert num_slots_for(384, 63, 63) == 504 == 8 * 63


@pytest.mark.parametrize("num_gpus,num_redundant", [(1, 0), (3, 0), (7, 5), (16, 1), (63, 0)])
def test_rounding_is_the_least_total_that_divides(num_gpus, num_redundant):
    extra = total_redundant(384, num_gpus, num_redundant)
    assert extra >= num_redundant and (384 + extra) % num_gpus == 0
    assert extra - num_redundant < num_gpus


def test_startup_copies_go_to_experts_in_index_order():
    layout = startup_layout(384, 8, 32)
    assert layout.phy2log[:384] == tuple(range(384))
    assert layout.phy2log[384:] == tuple(range(32))
    assert layout.slots_per_gpu == 52


def test_full_run_start_layout_is_1_20():
    start = startup_layout(5, 2, 1)
    assert start.gpu_experts() == [[0, 1, 2], [3, 4, 0]]
    assert gpu_loads(FULL_RUN, start).max(axis=1).tolist() == [115, 125]
    assert moe_lb(FULL_RUN, start) == pytest.approx(1.20)


def test_full_run_stage_a_copies_e0():
    assert stage_a(FULL_RUN, 6) == [0, 1, 2, 3, 4, 0]


def test_full_run_plan_is_1_05():
    plan = deepinfer_plan(FULL_RUN, 2, 6)
    assert plan.gpu_experts() == [[0, 1, 3], [0, 2, 4]]
    assert gpu_loads(FULL_RUN, plan).tolist() == [[105, 95], [105, 95]]
    assert moe_lb(FULL_RUN, plan) == pytest.approx(1.05)


def test_greedy_worse_start_is_1_057_and_deepinfer_makes_it_1_114():
    start = startup_layout(5, 2, 1)
    assert moe_lb(GREEDY_WORSE, start) == pytest.approx(353 / 334)
    assert round(moe_lb(GREEDY_WORSE, start), 3) == 1.057
    plan = deepinfer_plan(GREEDY_WORSE, 2, 6)
    assert plan.gpu_experts() == [[3, 1, 0], [2, 4, 0]]
    assert moe_lb(GREEDY_WORSE, plan) == pytest.approx(372 / 334)
    assert round(moe_lb(GREEDY_WORSE, plan), 3) == 1.114


def test_pass4_start_layout_is_1_42():
    start = startup_layout(4, 2, 2)
    assert start.gpu_experts() == [[0, 1, 2], [3, 0, 1]]
    assert gpu_loads(PASS4, start).tolist() == [[60, 140], [50, 130]]
    assert moe_lb(PASS4, start) == pytest.approx(270 / 190)


def test_pass4_e3_gets_three_copies():
    assert stage_a(PASS4, 6) == [0, 1, 2, 3, 3, 3]


def test_pass4_stage_b_keeps_slot_order_on_ties_and_answers_the_exercise():
    # Copies by load per copy: e3, e3, e3 (tied: slot order), e1, e2, e0. The first e3 copy ties on both
    # GPUs and goes to GPU0; the third ties again and goes to GPU0; e0 is left the one free slot on GPU0.
    plan = deepinfer_plan(PASS4, 2, 6)
    assert plan.gpu_experts() == [[3, 3, 0], [3, 1, 2]]
    assert moe_lb(PASS4, plan) == pytest.approx((110 + 280 / 3) / 190)  # 1.070


def test_stage_b_ties_go_to_the_lower_gpu():
    # Two identical experts on 2 GPUs, 1 slot each: the first copy ties and must take GPU0.
    assert stage_b(np.array([[5, 5]]), [0, 1], 2) == (0, 1)
    assert stage_b(np.array([[5, 5]]), [1, 0], 2) == (1, 0)


def test_stage_a_has_no_cap_per_expert():
    # A single spike: every extra copy goes to the one hot expert, more copies than experts.
    load = np.array([[1000, 1, 1, 1]])
    assert stage_a(load, 12) == [0, 1, 2, 3] + [0] * 8


def test_maps_agree():
    layout = deepinfer_plan(GREEDY_WORSE, 2, 6)
    assert layout.log2phy() == [[2, 5], [1], [3], [0], [4]]
    assert layout.copies().tolist() == [2, 1, 1, 1, 1]
    assert Layout.from_dict(layout.to_dict()) == layout


def test_layout_rejects_a_missing_expert():
    with pytest.raises(LayoutError, match="no slot"):
        Layout((0, 0, 1, 1), 2, 3)


def test_stage_a_breaks_ties_by_total_load_then_index():
    # After e1's first copy both copies carry 100: the tie goes to e1, whose total (200) is larger.
    assert stage_a(np.array([[100, 200]]), 4) == [0, 1, 1, 1]
    # Equal totals: the lower index.
    assert stage_a(np.array([[100, 100]]), 3) == [0, 1, 0]


def test_stage_a_spreads_copies_over_the_hottest_experts_of_a_uniform_load():
    # The old scoring tied every candidate here and piled the copies onto expert 0.
    copies = np.bincount(stage_a(np.ones((4, 256)), 320), minlength=256)
    assert copies.tolist() == [2] * 64 + [1] * 192
    rng = np.random.default_rng(0)
    load = rng.multinomial(16384, np.full(256, 1 / 256), size=8)
    copies = np.bincount(stage_a(load, 320), minlength=256)
    assert copies.max() == 2
    assert set(np.flatnonzero(copies == 2)) == set(np.argsort(-load.sum(axis=0), kind="stable")[:64])


def test_minimal_case_from_the_issue_gives_1_32():
    load = np.array([[1, 100, 100, 1]])
    plan = deepinfer_plan(load, 4, 8)
    assert plan.copies().tolist() == [1, 3, 3, 1]
    assert moe_lb(load, plan) == pytest.approx((200 / 3) / (202 / 4))
