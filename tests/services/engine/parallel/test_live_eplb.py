"""Live EPLB on ``LLM(data_parallel_size=2)`` (gloo, tiny, batch-invariant): a layout submitted mid-generation
moves in the background and takes effect at one step boundary agreed by both ranks, even when the ranks
receive it at different steps; greedy tokens equal those with no layout applied; the moved slots hold the checkpoint's
bytes; a plan of another shape is refused and the next one still applies; a planner's plan from recorded
receiving-side counts predicts the moe_lb of the replayed load exactly."""

from __future__ import annotations

import itertools
import time

import numpy as np
import pytest

from model.deepseek_v41.presets import TINY
from services.engine.llm import LLM
from services.engine.model_source import load_model
from services.engine.parallel.live_plans import PlanIntake, slot_load_report, update_from_plan
from services.engine.parallel.rank import run_to_completion
from services.engine.parallel.ranks import spread_by_load
from services.engine.sampling_params import SamplingParams
from services.eplb.guarded import PlanConfig
from services.eplb.layout import Layout, peak_sum, startup_layout
from services.eplb.messages import decode_plan
from services.eplb.planner import Planner, PlannerConfig

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 37)), [17, 18], [40, 41, 42, 43, 44], [50]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
SHORT = SamplingParams(temperature=0.0, max_tokens=4)
# No prefix cache: the replay of recorded prompts must route every prompt token again, as the recording did.
ENGINE = dict(
    batch_invariant=True,
    max_num_seqs=4,
    max_num_batched_tokens=64,
    max_model_len=64,
    block_size=16,
    device="cpu",
    enable_prefix_caching=False,
)
LAYERS = TINY.num_hidden_layers
# No redundant copies (so the moe_lb prediction is exact, below): 8 slots, 4 a rank. Start-up: rank 0 holds
# experts 0-3, rank 1 experts 4-7. MOVED moves 1 and 2 to rank 1 and 5 and 7 to rank 0, in new slot orders;
# SWAPPED then trades rank 0's 7 and 5 for rank 1's 4 and 1. (Copies moving and added: test_ranks.py.)
MOVED = Layout((7, 0, 3, 5, 6, 1, 2, 4), num_gpus=2, num_logical=8)
SWAPPED = Layout((4, 0, 3, 1, 6, 7, 2, 5), num_gpus=2, num_logical=8)


def _expert_weights(rank) -> list[tuple[bytes, bytes, bytes]]:
    """On a rank: each layer's (w1, w3, w2) bytes, slot order."""
    return [
        tuple(getattr(block.ffn.moe, n).detach().numpy().tobytes() for n in ("w1", "w3", "w2"))
        for block in rank.model.layers
    ]


def _switches(rank) -> tuple[int, list[tuple[int, int]]]:
    """On a rank: the version in force and the (version, boundary) log of its switches."""
    return rank.live.version, list(rank.live.switches)


def _num_boundaries(rank) -> int:
    return rank.live.num_boundaries


def _slow_moves(rank, slow_rank: int, delay_steps: int) -> None:
    """On a rank: from now on ``slow_rank``'s mover waits, after each update's last layer, until its rank
    has crossed ``delay_steps`` more step boundaries (every layer's copies are collective, so a delay before
    would hold both movers back alike): its moves finish steps after its peer's, counted in steps, not in
    seconds, so a fast machine's generation cannot end first. A 30 s cap keeps a stalled loop from hanging
    the mover. ``delay_steps`` 0 restores the module's function."""
    from services.worker.parallel import expert_moves, live_layouts

    if rank.rank != slow_rank or delay_steps == 0:
        live_layouts.moved_weights = expert_moves.moved_weights
        return

    calls = itertools.count(1)

    def slow(*args):
        out = expert_moves.moved_weights(*args)
        if next(calls) % LAYERS == 0:  # the tests' updates move every layer
            target, deadline = rank.live.num_boundaries + delay_steps, time.monotonic() + 30.0
            while rank.live.num_boundaries < target and time.monotonic() < deadline:
                time.sleep(0.002)
        return out

    live_layouts.moved_weights = slow


def _record(rank, requests) -> list:
    """On a rank: runs its share of ``requests`` and reports each step's receiving-side slot counts."""
    share = spread_by_load(requests, rank.groups.world_size)[rank.rank]
    rank.parallel.take_slot_counts()  # only this call's steps
    reports = []

    def take() -> None:
        reports.append(slot_load_report(rank.parallel, rank.rank, len(reports), rank.live.version))

    run_to_completion(rank, share, on_step=take)
    return reports


def _assert_checkpoint_bytes(llm: LLM, layouts: list[Layout]) -> None:
    full = load_model("tiny", 0).model
    for rank, layers in enumerate(llm.ranks.call(_expert_weights)):
        for layer, got in enumerate(layers):
            s = layouts[layer].slots_per_gpu
            experts = list(layouts[layer].phy2log[rank * s : (rank + 1) * s])
            moe = full.layers[layer].ffn
            assert got == tuple(w[experts].detach().numpy().tobytes() for w in (moe.w1, moe.w3, moe.w2))


def _logical(reports_by_rank: list, layer: int, layout: Layout) -> np.ndarray:
    """[step, logical expert] load of ``layer`` from every rank's slot counts under ``layout``."""
    load = np.zeros((len(reports_by_rank[0]), layout.num_logical), dtype=np.int64)
    for reports in reports_by_rank:
        for step, report in enumerate(reports):
            np.add.at(load[step], layout.array(), report.counts[layer])
    return load


@pytest.fixture(scope="module")
def no_apply(two_ranks):
    """Greedy tokens of PROMPTS on the group with no layout on its way (two ranks equal one process in the
    batch-invariant mode: test_ranks.py)."""
    assert two_ranks.ranks.settle_layouts()[0] == two_ranks.ranks.num_layout_versions
    return [o.token_ids for o in two_ranks.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def two_ranks(one_torch_thread):
    llm = LLM("tiny", data_parallel_size=2, rank_timeout_s=20.0, **ENGINE)
    yield llm
    llm.close()


def test_moe_lb_of_the_replayed_load_equals_the_plans_prediction(two_ranks):
    # First on the group: the planner starts from the start-up layout, as the ranks do. No redundant copies,
    # so every pair goes to its expert's one slot and the plan's even split over copies is exact.
    llm = two_ranks
    ranks = llm.ranks
    assert ranks.call(_switches) == [(0, [])] * 2, "this test runs first on the group"
    skewed = [[5, 5, 5, 5, 5, 5], [5, 5, 5], [6, 5, 5, 5], [5, 5], [5, 6, 5, 6, 5], [5]]
    requests = [(str(i), p, SHORT) for i, p in enumerate(skewed)]
    recorded = ranks.call(_record, requests)
    num_steps = len(recorded[0])
    planner = Planner(
        PlannerConfig(
            num_logical=8,
            num_gpus=2,
            num_redundant=0,
            num_layers=LAYERS,
            num_ranks=2,
            interval=10**6,
            window=num_steps,
            plan=PlanConfig(threshold=0.0),
        )
    )
    for reports in recorded:
        for report in reports:
            planner.add(report)
    assert planner.num_completed == num_steps
    start = startup_layout(8, 2, 0)
    outcome = planner.replan()
    plans = [decode_plan(m.encode()) for m in outcome.plans]  # as they travel over NATS
    assert plans, "the skewed load leaves the start-up layout in force on every layer"
    for plan in plans:
        assert ranks.submit_layouts(update_from_plan(plan).layouts) == plan.version
    assert ranks.settle_layouts() == [plans[-1].version] * 2
    layouts = [planner.layout(layer) for layer in range(LAYERS)]
    _assert_checkpoint_bytes(llm, layouts)
    replayed = ranks.call(_record, [(str(100 + i), p, SHORT) for i, p in enumerate(skewed)])
    assert len(replayed[0]) == num_steps
    for layer in range(LAYERS):
        # [step, gpu]: the pairs that arrived at each rank's slots (the receiving side).
        got = np.stack(
            [np.array([r.counts[layer, rank * 4 : rank * 4 + 4].sum() for r in replayed[rank]]) for rank in range(2)],
            axis=1,
        ).astype(np.float64)
        # The replay routed the same logical load, step by step (batch-invariant and deterministic).
        np.testing.assert_array_equal(_logical(replayed, layer, layouts[layer]), _logical(recorded, layer, start))
        lb = peak_sum(got) / (float(got.sum()) / 2)
        predicted = [p.moe_lb_after for p in plans if p.layer == layer]
        if predicted:
            assert lb == predicted[-1], (layer, lb, predicted)
        assert lb == outcome.moe_lb[layer]


def test_a_layout_applied_mid_generation_switches_at_one_step_and_keeps_tokens(two_ranks, no_apply):
    ranks = two_ranks.ranks
    # Rank 0 gets the layout before step 1, rank 1 before step 3: the moves start once both have it. Rank 1's
    # moves then finish a few steps after rank 0's (a slow mover): the switch must wait for them on both.
    version = ranks.submit_layouts({layer: MOVED for layer in range(LAYERS)}, at_step=[1, 3])
    first, _ = ranks.call(_num_boundaries)
    ranks.call(_slow_moves, 1, 3)
    try:
        outputs = ranks.generate([(str(i), p, GREEDY) for i, p in enumerate(PROMPTS)])
    finally:
        ranks.call(_slow_moves, 1, 0)
    (v0, log0), (v1, log1) = ranks.call(_switches)
    assert v0 == v1 == version
    assert log0 == log1  # the same boundary on every rank
    assert [o.token_ids for o in outputs] == no_apply
    (boundary,) = [b for v, b in log0 if v == version]
    # Boundaries of the call: one before each step and the last (no work); the switch came with steps left.
    num_steps = max(len(t) for t in no_apply) + 1
    assert 3 < boundary - first < num_steps - 1, (boundary - first, num_steps)
    _assert_checkpoint_bytes(two_ranks, [MOVED] * LAYERS)


def test_a_plan_of_another_shape_is_refused_and_the_next_applies(two_ranks, no_apply):
    ranks = two_ranks.ranks
    before = ranks.call(_switches)[0][0]
    bad = ranks.submit_layouts({0: startup_layout(8, 4, 0)})  # 4 ranks: refused on both, version used up
    good = ranks.submit_layouts({layer: SWAPPED for layer in range(LAYERS)}, at_step=2)
    assert bad == before + 1 and good == bad + 1
    outputs = ranks.generate([(str(100 + i), p, SHORT) for i, p in enumerate(PROMPTS[:3])])
    assert [o.token_ids for o in outputs] == [t[: SHORT.max_tokens] for t in no_apply[:3]]  # greedy: a prefix
    assert ranks.settle_layouts() == [good, good]
    _assert_checkpoint_bytes(two_ranks, [SWAPPED] * LAYERS)
    # Bad bytes on the plan subject are refused without touching the ranks' versions.
    assert not PlanIntake(None).take(b"{not json")  # type: ignore[arg-type]
