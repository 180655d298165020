"""Properties of the policy and the guarded planner on random small layers."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.eplb.assignment import min_move_relabel
from services.eplb.guarded import PlanConfig, plan
from services.eplb.layout import Layout, count_moves, moe_lb, needless_colocations, startup_layout
from services.eplb.policy import deepinfer_plan
from services.eplb.search import local_search, spread_out

SETTINGS = settings(max_examples=60, deadline=None)


@st.composite
def layers(draw):
    """(load, current layout): a random window and a random valid layout of the same shape."""
    num_gpus = draw(st.integers(1, 4))
    num_logical = draw(st.integers(1, 9))
    num_redundant = draw(st.integers(0, 6))
    steps = draw(st.integers(1, 5))
    load = np.array(
        draw(
            st.lists(
                st.lists(st.integers(0, 200), min_size=num_logical, max_size=num_logical),
                min_size=steps,
                max_size=steps,
            )
        )
    )
    start = startup_layout(num_logical, num_gpus, num_redundant)
    shuffled = draw(st.permutations(start.phy2log))
    extra = draw(
        st.lists(
            st.integers(0, num_logical - 1),
            min_size=start.num_slots - num_logical,
            max_size=start.num_slots - num_logical,
        )
    )
    # Any valid layout: every expert once, then arbitrary copies, in a random order.
    phy2log = list(range(num_logical)) + extra
    order = draw(st.permutations(range(len(phy2log))))
    current = Layout(tuple(phy2log[i] for i in order), num_gpus, num_logical)
    return load, draw(st.sampled_from([start, Layout(tuple(shuffled), num_gpus, num_logical), current]))


def assert_maps_consistent(layout: Layout) -> None:
    log2phy = layout.log2phy()
    assert all(len(slots) >= 1 for slots in log2phy)
    assert sorted(s for slots in log2phy for s in slots) == list(range(layout.num_slots))
    for expert, slots in enumerate(log2phy):
        assert all(layout.phy2log[s] == expert for s in slots)
    groups = layout.gpu_experts()
    assert [len(g) for g in groups] == [layout.slots_per_gpu] * layout.num_gpus
    assert tuple(e for g in groups for e in g) == layout.phy2log
    assert layout.counts_per_gpu().sum(axis=1).tolist() == layout.copies().tolist()


@SETTINGS
@given(layers(), st.sampled_from(["deepinfer", "deepseek", "guarded"]))
def test_maps_are_consistent(layer, policy):
    load, current = layer
    result = plan(load, current, PlanConfig(policy=policy))
    assert_maps_consistent(result.layout)
    assert_maps_consistent(result.candidate)
    assert result.layout.num_slots == current.num_slots


@SETTINGS
@given(layers())
def test_guarded_adds_needless_colocations_only_by_taking_a_start_as_it_is(layer):
    # Co-located copies do not change moe_lb, so a policy's plan or the current layout that has them is a
    # candidate as it is; local search never adds one.
    load, current = layer
    result = plan(load, current, PlanConfig())
    if needless_colocations(result.candidate) > 0:
        assert result.source in ("current", "deepinfer", "deepseek")
    if result.source.endswith("+search") or result.source.endswith("+spread"):
        assert needless_colocations(result.candidate) == 0


@SETTINGS
@given(layers(), st.sampled_from([0.0, 0.01, 0.1]))
def test_guarded_is_never_worse_than_current_on_its_window(layer, threshold):
    load, current = layer
    result = plan(load, current, PlanConfig(threshold=threshold))
    assert result.moe_lb_after <= result.moe_lb_before + 1e-12
    assert result.moe_lb_after == moe_lb(load, result.layout)
    if result.applied:
        assert result.moe_lb_before - result.moe_lb_after >= threshold
    else:
        assert result.layout == current and result.moves == 0


@SETTINGS
@given(layers(), st.sampled_from(["deepinfer", "deepseek", "guarded"]))
def test_plans_are_deterministic(layer, policy):
    load, current = layer
    first = plan(load, current, PlanConfig(policy=policy))
    again = plan(load.copy(), Layout(current.phy2log, current.num_gpus, current.num_logical), PlanConfig(policy=policy))
    assert first == again


@SETTINGS
@given(layers())
def test_local_search_only_lowers_moe_lb(layer):
    load, current = layer
    improved = local_search(spread_out(current, load), load)
    assert moe_lb(load, improved) <= moe_lb(load, spread_out(current, load)) + 1e-12
    assert needless_colocations(improved) == 0


@SETTINGS
@given(layers())
def test_min_move_relabel_keeps_quality_and_never_moves_more(layer):
    load, current = layer
    candidate = deepinfer_plan(load, current.num_gpus, current.num_slots)
    relabelled = min_move_relabel(candidate, current)
    assert sorted(map(sorted, relabelled.gpu_experts())) == sorted(map(sorted, candidate.gpu_experts()))
    assert abs(moe_lb(load, relabelled) - moe_lb(load, candidate)) < 1e-12
    assert count_moves(current, relabelled) <= count_moves(current, candidate)
    assert count_moves(current, min_move_relabel(current, current)) == 0


@SETTINGS
@given(layers(), st.integers(1, 5))
def test_the_proxy_window_keeps_each_gpus_total(layer, repeat):
    # Long windows are ranked on summed blocks of steps; every block sum keeps the GPU totals.
    from services.eplb.search_state import PROXY_ROWS, SearchState

    load, current = layer
    long = np.repeat(load, PROXY_ROWS * repeat, axis=0).astype(np.float64)
    state = SearchState(long, current.array(), current.num_gpus)
    assert state.proxy.shape[0] == min(PROXY_ROWS, len(long))
    np.testing.assert_allclose(state.pgpu.sum(axis=0), state.gpu_load.sum(axis=0), rtol=1e-12, atol=1e-9)
    assert state.score() == pytest.approx(float(state.gpu_load.max(axis=1).sum()))


@SETTINGS
@given(
    layers(),
    st.lists(st.tuples(st.integers(0, 3), st.integers(0, 20), st.integers(0, 3), st.integers(0, 20)), max_size=6),
)
def test_incremental_swaps_match_a_fresh_state(layer, swaps):
    from services.eplb.search_state import SearchState

    load, current = layer
    state = SearchState(load.astype(np.float64), current.array().copy(), current.num_gpus)
    for g, i, h, j in swaps:
        g, h, i, j = g % state.num_gpus, h % state.num_gpus, i % state.slots_per_gpu, j % state.slots_per_gpu
        if g != h:
            state.swap(g, i, h, j)
    fresh = SearchState(load.astype(np.float64), state.phy2log.copy(), current.num_gpus)
    assert state.pgpu.sum(axis=0) == pytest.approx(state.gpu_load.sum(axis=0))
    for name in ("held", "slot_load", "gpu_load", "pslot", "pgpu", "pslot_by_gpu"):
        np.testing.assert_allclose(getattr(state, name), getattr(fresh, name), rtol=1e-6, atol=1e-6)
    assert state.score() == pytest.approx(fresh.score())


@SETTINGS
@given(layers(), st.sampled_from([0.0, 0.002, 0.05]))
def test_guarded_pick_is_within_the_tolerance_of_every_policys_plan(layer, tolerance):
    from services.eplb.deepseek import deepseek_plan

    load, current = layer
    result = plan(load, current, PlanConfig(tolerance=tolerance))
    for policy_plan in (
        deepinfer_plan(load, current.num_gpus, current.num_slots, spread=True),
        deepseek_plan(load, current.num_gpus, current.num_slots),
    ):
        assert result.moe_lb_candidate <= moe_lb(load, policy_plan) + tolerance + 1e-12
    assert result.moe_lb_candidate <= min(p.moe_lb for p in result.tradeoff) + tolerance + 1e-12


@SETTINGS
@given(layers(), st.sampled_from([0.0, 0.002, 0.01]))
def test_planning_its_own_output_again_applies_nothing(layer, threshold):
    load, current = layer
    config = PlanConfig(threshold=threshold)
    first = plan(load, current, config)
    again = plan(load, first.layout, config)
    assert not again.applied and again.moves == 0, again.reason
