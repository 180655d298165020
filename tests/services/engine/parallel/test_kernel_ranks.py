"""Two ranks on the kernel backend (CPU, gloo; the MoE's kernels interpreted: tests/services/engine/parallel/
kernel_ranks.py): each rank converts its model, shards every ``KernelMoE`` to its slots and exchanges through the
fixed-capacity buffers (services/worker/parallel/ep_kernel_moe.py).

In the batch-invariant mode a greedy and a seeded request spread over the two ranks give one process's tokens
and logprobs with ``==``, while the ranks run placeholder steps (rank 1's request ends first) and prefill steps
of several passes (two tokens a pass: ``max_num_seqs`` 2), agreed on the host group. With a live EPLB layout
received before the first step, whose moves (FP8 codes and scales copied into the stacks in place) take effect
between the prefill and the decode steps on both ranks at one boundary, the tokens and logprobs are one process's
still; a layout applied between calls (``apply_expert_layouts``) moves the kernel stacks too. With MXFP4 experts
and DSpark drafts (a one-stage draft on the same backbone; drafts rewritten so that some are accepted and some
rejected) and a live move of the MXFP4 stacks switched after the prefill, the ranks' tokens and logprobs are one
process's with drafts and without the move.
A rank SIGKILLed mid-generate ends the call with an error naming it, and no rank process is left.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from services.engine.config import EngineConfig
from services.engine.llm import LLM
from services.engine.parallel.rank import (
    RankSpec,
    apply_expert_layouts,
    build_rank,
    rank_engine_args,
    run_to_completion,
)
from services.engine.parallel.ranks import Ranks, spread_by_load
from services.engine.sampling_params import SamplingParams
from services.eplb.layout import Layout, startup_layout
from services.worker.parallel.live_layouts import LayoutUpdate
from tests.services.engine.parallel.kernel_ranks import (
    NUM_LAYERS,
    moe_kernels,
    three_layer_tiny,
    three_layer_tiny_with_draft,
)

ENGINE = dict(
    kernel_backend="fp8",
    expert_format="fp8",
    batch_invariant=True,
    max_num_seqs=2,
    max_num_batched_tokens=16,
    max_model_len=32,
    block_size=16,
    num_blocks=8,
    device="cpu",
)
# spread_by_load puts the first on rank 0 and the second on rank 1 (load 7 each: ties go to the lower rank's
# peer once it holds one); rank 1's request is one token shorter, so rank 1 steps on with a placeholder step.
REQUESTS = [
    ("greedy", [1, 5, 9, 13], SamplingParams(temperature=0.0, max_tokens=3)),
    ("seeded", [1, 7, 7, 2, 3], SamplingParams(temperature=0.8, seed=3, max_tokens=2)),
]


DRAFTS = 2
DRAFTED = dict(ENGINE, expert_format="fp4", num_speculative_tokens=DRAFTS)  # MXFP4 routed experts


def known_drafts(continuations: dict[str, tuple[int, list[int]]]):
    """Drafts = the request's continuation without drafts (request id → (prompt length, its tokens)), every second
    one wrong: random draft weights accept almost nothing, so acceptance, partial acceptance and rejection all
    happen."""

    def rewrite(request_id: str, anchor: int, drafts: list[int]) -> list[int]:
        prompt_len, out = continuations[request_id]
        first = anchor + 1 - prompt_len  # output index of the token at anchor + 1
        proposal = []
        for j, d in enumerate(drafts):
            token = out[first + j] if 0 <= first + j < len(out) else d
            proposal.append((token + 1) % 100 if (anchor + j) % 2 == 0 else token)
        return proposal

    return rewrite


def drafted_generate(rank, requests, continuations) -> tuple[list, int, int, list[tuple[int, int]], int]:
    """On a rank: a second engine, MXFP4 experts and drafts, built on the rank's groups and kernel set; its share
    of ``requests`` run to completion with MOVED received before the first step: (outputs, drafts verified,
    drafts accepted, the (version, boundary) switches, boundaries: one before each step and the last)."""
    config = EngineConfig(data_parallel_size=rank.groups.world_size, **DRAFTED)
    spec = RankSpec(config, three_layer_tiny_with_draft, "", "cpu", 1)
    built = build_rank(rank.rank, spec, rank.groups, kernels=rank.engine.worker.runner.kernels)
    try:
        assert all(block.ffn.moe.fp4 is not None for block in built.model.layers)
        speculator = built.engine.worker.speculator
        speculator.rewrite_drafts = known_drafts(continuations)
        move = LayoutUpdate(1, {layer: MOVED for layer in range(NUM_LAYERS)})
        share = spread_by_load(requests, rank.groups.world_size)[rank.rank]
        outputs = run_to_completion(built, share, updates_at={0: [move]})
        live = built.live
        return (
            outputs,
            speculator.num_drafts_verified,
            speculator.num_drafts_accepted,
            live.switches,
            live.num_boundaries,
        )
    finally:
        built.live.close()


def instrument(rank) -> None:
    """On a rank: records each step's plan kind and the passes the group agreed."""
    parallel, runner = rank.parallel, rank.engine.worker.runner
    rank.steps = []
    agree, execute = parallel.agree_passes, runner.execute

    def agreed(num_tokens: int) -> int:
        passes = agree(num_tokens)
        if rank.steps and rank.steps[-1][1] is None:
            rank.steps[-1] = (rank.steps[-1][0], passes)
        return passes

    def executing(plan, *args, **kwargs):
        rank.steps.append((plan.is_placeholder, None))
        return execute(plan, *args, **kwargs)

    parallel.agree_passes, runner.execute = agreed, executing


def recorded(rank) -> list:
    return rank.steps


# Start-up: rank 0 holds experts 0-3, rank 1 experts 4-7; MOVED trades 1 and 2 for 5 and 7, in new slot orders.
MOVED = Layout((7, 0, 3, 5, 6, 1, 2, 4), num_gpus=2, num_logical=8)


def layouts_in_force(rank) -> tuple[int, list[tuple[int, int]], int, list[Layout]]:
    """On a rank: the version in force, its (version, boundary) switches, boundaries seen and every layer's layout."""
    live = rank.live
    return live.version, list(live.switches), live.num_boundaries, [s.layout for s in rank.parallel.slots]


@pytest.fixture(scope="module")
def one_process(one_torch_thread):
    llm = LLM(source=three_layer_tiny("cpu"), kernels=moe_kernels, **ENGINE)
    try:
        outs = llm.generate([r[1] for r in REQUESTS], [r[2] for r in REQUESTS])  # in prompt order
        return {r[0]: o for r, o in zip(REQUESTS, outs, strict=True)}
    finally:
        llm.close()


def _continuations(one_process) -> dict[str, tuple[int, list[int]]]:
    """By the drafted runs' request ids (prompt order): each prompt's length and its tokens without drafts."""
    return {str(i): (len(ids), one_process[name].token_ids) for i, (name, ids, _) in enumerate(REQUESTS)}


@pytest.fixture(scope="module")
def one_process_drafted(one_process):
    """One process with MXFP4 experts and drafts: outputs in prompt order (request ids "0", "1"), drafts verified
    and accepted."""
    llm = LLM(source=three_layer_tiny_with_draft("cpu"), kernels=moe_kernels, **DRAFTED)
    try:
        speculator = llm.engine.worker.speculator
        speculator.rewrite_drafts = known_drafts(_continuations(one_process))
        outs = llm.generate([r[1] for r in REQUESTS], [r[2] for r in REQUESTS])
        return outs, speculator.num_drafts_verified, speculator.num_drafts_accepted
    finally:
        llm.close()


@pytest.fixture(scope="module")
def two_ranks():
    config = EngineConfig(data_parallel_size=2, **ENGINE)
    ranks = Ranks(RankSpec(config, three_layer_tiny, "", "cpu", 1, kernels=moe_kernels))
    yield ranks
    ranks.close()


def test_the_config_takes_kernels_and_graphs_with_ranks():
    EngineConfig(data_parallel_size=2, kernel_backend="fp8", cuda_graphs=True, device="cpu")  # no refusal
    EngineConfig(data_parallel_size=2, kernel_backend="fp8", expert_format="fp4")
    with pytest.raises(ValueError, match="runs its FP8 form"):
        EngineConfig(data_parallel_size=2, kernel_backend="fp32")
    cuda = rank_engine_args({}, "cuda")  # a rank's defaults on a GPU: one process's fast path
    assert (cuda["kernel_backend"], cuda["expert_format"], cuda["cuda_graphs"]) == ("fp8", "fp4", True)
    assert rank_engine_args({"enforce_eager": True}, "cuda")["cuda_graphs"] is False
    assert rank_engine_args({"num_speculative_tokens": 2}, "cuda")["cuda_graphs"] is False
    assert rank_engine_args({}, "cpu")["kernel_backend"] is None


def test_two_kernel_ranks_equal_one_process(two_ranks, one_process):
    two_ranks.call(instrument)
    outs = {o.request_id: o for o in two_ranks.generate(REQUESTS)}
    for request_id, want in one_process.items():
        got = outs[request_id]
        assert got.token_ids == want.token_ids, request_id
        assert got.logprobs == want.logprobs, request_id
    steps = two_ranks.call(recorded)
    assert len(steps[0]) == len(steps[1])  # lockstep
    assert any(placeholder for placeholder, _ in steps[1]), "rank 1 never ran a placeholder step"
    assert max(passes for _, passes in steps[0]) == 3  # the prefill: 5 tokens (rank 1's) in passes of 2
    assert [p for _, p in steps[0]] == [p for _, p in steps[1]]  # every step's passes agreed


def test_a_live_move_mid_run_keeps_one_process_bits(two_ranks, one_process):
    _, _, first, _ = two_ranks.call(layouts_in_force)[0]
    version = two_ranks.submit_layouts({layer: MOVED for layer in range(NUM_LAYERS)}, at_step=0)
    outs = {o.request_id: o for o in two_ranks.generate([(f"{i}-moved", p, s) for i, p, s in REQUESTS])}
    for request_id, want in one_process.items():
        got = outs[f"{request_id}-moved"]
        assert got.token_ids == want.token_ids, request_id
        assert got.logprobs == want.logprobs, request_id
    (v0, log0, _, layouts0), (v1, log1, _, layouts1) = two_ranks.call(layouts_in_force)
    assert v0 == v1 == version and log0 == log1  # one boundary on both ranks
    assert layouts0 == layouts1 == [MOVED] * NUM_LAYERS
    (boundary,) = [b for v, b in log0 if v == version]
    num_steps = max(len(o.token_ids) for o in outs.values())  # the prefill, then one decode step a token
    # Boundary `first` starts the moves (the layout arrived before it); the switch came after the prefill and
    # with a decode step left to run on the moved experts.
    assert 0 < boundary - first < num_steps, (boundary - first, num_steps)
    # Back to the start-up layout between calls (synchronously): each rank takes two experts a layer from its peer.
    start = startup_layout(8, 2, 0)
    assert two_ranks.call(apply_expert_layouts, [start] * NUM_LAYERS) == [2 * NUM_LAYERS] * 2
    assert [layouts for *_, layouts in two_ranks.call(layouts_in_force)] == [[start] * NUM_LAYERS] * 2


def test_drafts_and_a_live_fp4_move_on_two_kernel_ranks_equal_one_process(two_ranks, one_process, one_process_drafted):
    want, verified, accepted = one_process_drafted
    assert 0 < accepted < verified  # drafts both accepted and rejected
    requests = [(str(i), ids, params) for i, (_, ids, params) in enumerate(REQUESTS)]
    parts = two_ranks.call(drafted_generate, requests, _continuations(one_process))
    got = {o.request_id: o for outs, *_ in parts for o in outs}
    for i, (name, _, _) in enumerate(REQUESTS):
        assert got[str(i)].token_ids == want[i].token_ids, name
        assert got[str(i)].logprobs == want[i].logprobs, name
    assert sum(p[1] for p in parts) == verified and sum(p[2] for p in parts) == accepted
    (switches, *_), others = [p[3] for p in parts], [p[3] for p in parts[1:]]
    assert all(o == switches for o in others) and [v for v, _ in switches] == [1]  # one boundary on both
    num_steps = parts[0][4] - 1  # the last boundary found no work
    assert 0 < switches[0][1] < num_steps, (switches, num_steps)  # after the prefill, a step left on the moved stacks


def test_a_killed_kernel_rank_is_an_error_and_leaves_no_process(two_ranks):
    errors: list[BaseException] = []

    def generate() -> None:
        try:
            two_ranks.generate([(f"long-{i}", r[1], SamplingParams(max_tokens=20)) for i, r in enumerate(REQUESTS)])
        except BaseException as e:  # noqa: BLE001 - checked below
            errors.append(e)

    thread = threading.Thread(target=generate)
    thread.start()
    time.sleep(2.0)  # inside the run: 20 interpreted steps take far longer
    os.kill(two_ranks.pids[1], signal.SIGKILL)
    thread.join(timeout=90)
    assert not thread.is_alive(), "generate hung after a rank was killed"
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "rank 1 exited with code -9" in str(errors[0])
    for p in two_ranks.processes:
        assert not p.is_alive()
