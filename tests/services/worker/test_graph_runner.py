"""GraphRunner: captured CUDA graphs replay the static decode step (H200 tests), and its CPU guards.

On CUDA the tiny model's MoE is swapped for a dense, graph-safe twin (every expert for every row,
weighted by the same routing): the torch MoE loops over ``experts.unique().tolist()``, a host sync a
capture refuses; the kernel backend's MoE takes its place in production. Both runners share the
model, so they compare like for like.
"""

from __future__ import annotations

import contextlib
import time
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from model.deepseek_v41.moe import MoE, clamped_swiglu
from services.engine.config import EngineConfig
from services.worker.decode_step import StaticDecodeStep
from services.worker.graph_runner import GraphRunner
from services.worker.model_runner import ModelRunner
from tests import tolerances as tol
from tests.scheduler_rs.fake_worker import run_step
from tests.services.worker.test_decode_step import case, pool_differences, setup

# Twelve requests at max_num_seqs 16: decode steps of 12 … 1 rows run at graph sizes 16, 8, 4, 2, 1.
PROMPTS = (9, 14, 20, 27, 33, 11, 16, 22, 25, 30, 12, 18)
MAX_TOKENS = (24, 21, 23, 22, 20, 6, 8, 10, 12, 14, 16, 18)


def _dense_moe(self: MoE, x: torch.Tensor, counts: torch.Tensor | None = None) -> torch.Tensor:
    """``MoE.forward`` without data-dependent shapes: x [B, S, D] → [B, S, D]."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])  # [T, D]
    weights, experts = self.route(x)  # [T, k]
    if counts is not None:
        counts.scatter_add_(0, experts.flatten(), torch.ones_like(experts.flatten()))
    gate = torch.zeros(x.shape[0], self.w1.shape[0], device=x.device).scatter(1, experts, weights)  # [T, E]
    act = clamped_swiglu(torch.einsum("td,eid->tei", x, self.w1), torch.einsum("td,eid->tei", x, self.w3), self.limit)
    out = torch.einsum("tei,edi->td", (act * gate.unsqueeze(-1)).to(x.dtype), self.w2).float()
    shared = clamped_swiglu(F.linear(x, self.shared_w1), F.linear(x, self.shared_w3), self.limit).to(x.dtype)
    return (out.to(x.dtype) + F.linear(shared, self.shared_w2)).reshape(shape)


@contextlib.contextmanager
def graph_safe_moe(model: torch.nn.Module) -> Iterator[None]:
    for block in model.layers:
        block.ffn.forward = types.MethodType(_dense_moe, block.ffn)
    try:
        yield
    finally:
        for block in model.layers:
            del block.ffn.forward


def test_graphs_need_cuda_and_no_rounding_hook():
    model = case("oracle").model
    config = EngineConfig(block_size=16, max_model_len=64, max_num_seqs=2)
    with pytest.raises(ValueError, match="CUDA graphs need"):
        GraphRunner(ModelRunner(model, config), config, use_graphs=True, attention="reference")
    with pytest.raises(ValueError, match="rounding hook"):
        GraphRunner(ModelRunner(model, config, rounding=lambda *a: a[2]), config, use_graphs=False,
                    attention="reference")
    with pytest.raises(ValueError, match="attention must be"):
        GraphRunner(ModelRunner(model, config), config, use_graphs=False, attention="auto").step(1)


@pytest.mark.parametrize("name", ["oracle", "nocand"])
@pytest.mark.usefixtures("no_tf32")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graph_replays_equal_the_eager_static_step_and_model_runner(name):
    """Graphs for 1, 8 and 16 rows captured up front (the others lazily), replayed over every decode
    step: equal to the same static step run eagerly (bit for bit: same kernels, same shapes), and to
    ModelRunner as on CPU (each step from the eager runner's pools; bin flips allowed their move)."""
    model = case(name, "cuda").model
    with graph_safe_moe(model):
        sched, eager, graphs, token_at, config = setup(name, "cuda", "triton", True, PROMPTS, MAX_TOKENS, 16)
        static = GraphRunner(ModelRunner(model, config), config, use_graphs=False, attention="triton")
        graphs.capture([1, 8, 16])
        sizes, worst, worst_flipped, flipped = [], 0.0, 0.0, 0
        while sched.has_unfinished():
            plan = sched.schedule()
            for other in (graphs, static):
                other.runner.cache.blocks.copy_(eager.cache.blocks)
                other.runner.cache.slots.copy_(eager.cache.slots)
            want = eager.execute(plan, all_rows=True)
            got = graphs.execute(plan, all_rows=True)
            same = static.execute(plan, all_rows=True)
            if StaticDecodeStep.fits(plan):
                sizes.append(plan.graph_size)
                assert torch.equal(got.logits, same.logits) and torch.equal(got.expert_counts, same.expert_counts)
                assert pool_differences(graphs.runner.cache, static.runner.cache) == (0, 0.0, True)
                assert torch.equal(got.expert_counts, want.expert_counts)
                flips, partial, engram_equal = pool_differences(eager.cache, graphs.runner.cache)
                assert engram_equal and partial <= tol.FLIP_BOUNDARY_TOL
                delta = float((got.logits - want.logits).abs().max())
                if flips:
                    flipped += 1
                    worst_flipped = max(worst_flipped, delta)
                else:
                    worst = max(worst, delta)
            sched.update(plan, run_step(plan, token_at))
    print(f"\n{name}: {graphs.num_replays} replays at sizes {sorted(set(sizes))}, {graphs.num_eager} eager steps; "
          f"vs ModelRunner max |Δ| {worst:.3g} ({worst_flipped:.3g} on {flipped} steps with a bin flip)")
    assert graphs.num_replays == len(sizes) >= 10 and {1, 8, 16} <= set(sizes)
    assert worst <= tol.LOGITS_ATOL and worst_flipped < tol.SENSITIVITY_MIN_MOVE and flipped <= len(sizes) // 4


@pytest.mark.usefixtures("no_tf32")
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replay_time_against_eager():
    """µs per decode step at tiny shapes, 8 rows: graph replay vs the static step eagerly vs ModelRunner."""
    model = case("oracle", "cuda").model
    with graph_safe_moe(model):
        sched, eager, graphs, token_at, config = setup("oracle", "cuda", "triton", True, PROMPTS[:5], MAX_TOKENS[:5], 8)
        while not StaticDecodeStep.fits(plan := sched.schedule()):
            eager.execute(plan)
            sched.update(plan, run_step(plan, token_at))
        graphs.runner.cache.blocks.copy_(eager.cache.blocks)
        graphs.runner.cache.slots.copy_(eager.cache.slots)
        step = graphs.step(plan.graph_size)

        def timed(fn, n: int = 50) -> float:
            fn()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - start) / n * 1e6

        graphs.execute(plan)  # captures
        replay = timed(graphs._graphs[plan.graph_size].replay)
        static_eager = timed(step.run)
        runner = timed(lambda: eager.execute(plan))
        full = timed(lambda: graphs.execute(plan))
    print(f"\nGRAPH_TIMING rows {plan.num_rows} at size {plan.graph_size}: replay {replay:.0f} µs, execute with "
          f"prepare {full:.0f} µs, static step eager {static_eager:.0f} µs, ModelRunner {runner:.0f} µs")
    assert replay < static_eager


@pytest.fixture
def no_tf32():
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before
