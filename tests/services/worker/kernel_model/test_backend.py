"""The worker's kernel backend (services/worker/kernel_model/backend.py): the module swap, the FP8 linear and
kernel MoE under Triton's interpreter on CPU, the whole engine interpreted on CPU, and on a GPU the
engine's logits (fp32 path within tests/tolerances.py; FP8 path by KL and top-1 agreement) and a
profiled decode step that runs the Triton kernels and none of the torch references.

The model is test_model_runner.py's: a random tiny oracle config, teacher-forced requests driven by the
real scheduler through chunked prefill and decode, compared with the full-sequence reference logits.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os

import pytest
import torch
from torch import nn

from kernels import reference
from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.engram import Engram
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.norm import RMSNorm
from scheduler_rs import Scheduler, SchedulerConfig
from services.engine.config import EngineConfig
from services.worker.config import WorkerConfig
from services.worker.kernel_model.backend import FP8_PROJECTIONS, KernelHyperConnection, convert_model
from services.worker.kernel_model.draft_attention import KernelDraftAttention
from services.worker.kernel_model.engram import KernelEngram
from services.worker.kernel_model.fp8_linear import (
    META_CACHE_MAX_TOKENS,
    GroupedKernelLinear,
    KernelLinear,
    group_rows_meta,
    linear_block_m,
    one_expert_meta,
    quantize_each,
    quantize_padded,
)
from services.worker.kernel_model.head import KernelHead
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.moe import KernelMoE, KernelRMSNorm
from services.worker.kernel_model.row_tiled import RowTiledEngram, RowTiledLinear
from services.worker.runners.model_runner import ModelRunner
from services.worker.sampling.kernel_sampler import KernelSampler
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.worker import Worker
from tests import tolerances as tol
from tests.scheduler_rs.fake_worker import run_step
from tests.services.worker.runners.test_model_runner import BLOCK, MAX_TOKENS, Case, case, replay

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def interpreted() -> KernelSet:
    return KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


def converted(c: Case, precision: str, device: str = "cpu", kernels: KernelSet | None = None):
    model = copy.deepcopy(c.model).to(device)
    return model, convert_model(model, precision, kernels)


def drive(
    c: Case, runner: ModelRunner, budget: int, on_plan=None, decode_steps: int | None = None
) -> dict[tuple[str, int], torch.Tensor]:
    """Every request of ``c`` through the scheduler and ``runner`` (stopping after ``decode_steps`` steps
    without prefill rows, if given): logits (CPU) per (request, position) computed."""
    cfg, n = c.model.cfg, len(c.seqs)
    ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    sched = Scheduler(
        SchedulerConfig(
            block_size=BLOCK,
            num_blocks=64,
            num_state_slots=n + 1,
            max_num_seqs=n,
            max_num_batched_tokens=budget,
            max_model_len=128,
            window_size=cfg.sliding_window,
            compress_ratios=ratios,
        )
    )
    for rid, s in c.seqs.items():
        sched.add_request(rid, s[:-MAX_TOKENS], max_tokens=MAX_TOKENS, ignore_eos=True)
    logits = {}
    while sched.has_unfinished() and decode_steps != 0:
        plan = sched.schedule()
        if decode_steps is not None and all(n == 1 for n in plan.seqlens_q.tolist()):
            decode_steps -= 1
        out = (on_plan or (lambda p: runner.execute(p, all_rows=True)))(plan)
        assert out.expert_counts.sum(1).tolist() == [plan.num_rows * cfg.num_experts_per_tok] * cfg.num_hidden_layers
        for row, (pos, i) in enumerate(zip(plan.positions.tolist(), plan.row_requests.tolist())):
            logits[(plan.request_ids[i], pos)] = out.logits[row].float().cpu()
        sched.update(plan, run_step(plan, lambda rid, pos: c.seqs[rid][pos]))
    return logits


def runner_for(
    c: Case,
    model,
    budget: int,
    precision: str,
    kernels: KernelSet | None = None,
    rounding=None,
    expert_format: str = "fp8",
):
    config = dataclasses.replace(_config(c, budget), expert_format=expert_format)
    return ModelRunner(model, config, backend="kernels", precision=precision, kernels=kernels, rounding=rounding)


def worst_delta(c: Case, logits) -> tuple[float, int]:
    """Max |Δ| vs the reference over the positions before any oracle near tie; positions compared."""
    worst, compared = 0.0, 0
    for b, (rid, s) in enumerate(c.seqs.items()):
        for pos in range(min(len(s) - 1, c.exempt_from[rid])):
            if (rid, pos) not in logits:
                continue
            worst = max(worst, float((logits[(rid, pos)] - c.reference[b, pos].cpu()).abs().max()))
            compared += 1
    return worst, compared


def cpu_rounding(c: Case):
    """``replay(c)`` for a runner on another device: the recorded reference lives on the CPU."""
    hook = replay(c)
    return lambda kind, layer, x, ids, index: hook(kind, layer, x.cpu(), ids, index.cpu()).to(x.device)


# ---------------------------------------------------------------- CPU: conversion


def test_conversion_swaps_every_norm_moe_and_fp8_projection():
    c = case("oracle")
    cfg = c.model.cfg
    norms = sum(isinstance(m, RMSNorm) for m in c.model.modules())
    model, done = converted(c, "fp8", kernels=interpreted())
    assert (done.norms, done.moes, done.grouped) == (norms, cfg.num_hidden_layers, cfg.num_hidden_layers)
    fp8_linears = sum(len(names) for m in c.model.modules() for names in [FP8_PROJECTIONS.get(type(m).__name__, ())])
    assert done.linears == fp8_linears == sum(isinstance(m, KernelLinear) for m in model.modules())
    assert not any(isinstance(m, (RMSNorm, MoE)) for m in model.modules())
    assert sum(isinstance(m, KernelRMSNorm) for m in model.modules()) == norms
    assert sum(isinstance(m, KernelMoE) for m in model.modules()) == cfg.num_hidden_layers
    # What stays torch: the projections the checkpoint stores in bf16. The head's bf16 weight is read as bf16.
    assert isinstance(model.head, KernelHead) and model.head.weight.dtype == torch.bfloat16
    left = sorted(
        {
            name.split(".")[-2] + "." + name.split(".")[-1]
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear)
        }
    )
    assert left == ["compressor.wgate", "compressor.wkv", "indexer.wk", "weights_proj.linear"]
    # Engram's gate runs on its kernel (one program per row); the indexer's weights_proj stays torch, on fixed
    # row tiles in the batch-invariant mode (services/worker/kernel_model/row_tiled.py).
    assert sum(isinstance(m, KernelEngram) for m in model.modules()) == len(cfg.engram_layer_ids)
    assert not any(isinstance(m, RowTiledEngram) for m in model.modules())
    assert all(isinstance(m.weights_proj, RowTiledLinear) for m in model.modules() if type(m).__name__ == "Indexer")
    # The random checkpoint's FP8 (32×32 scales) and MXFP4 (1×32) weights land on the 128×128 grid exactly,
    # but for elements of a 32×32 block more than ~14 binades below its 128×128 block's largest scale,
    # which fall below e4m3's subnormals there (2 of 1.1M here, both in a dense wkv): rounded, not exact.
    fp8_elements = sum(b.numel() for name, b in model.named_buffers() if b.dtype == torch.float8_e4m3fn)
    assert done.inexact <= 1e-5 * fp8_elements


def test_kernel_backend_on_cpu_without_interpreter_is_refused():
    c = case("oracle")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        ModelRunner(
            copy.deepcopy(c.model),
            EngineConfig(block_size=BLOCK, max_model_len=64, max_num_seqs=2).worker_config(),
            backend="kernels",
        )
    with pytest.raises(ValueError, match="kernel_backend"):
        EngineConfig(kernel_backend="fp16")
    config = EngineConfig(block_size=BLOCK, max_model_len=64, max_num_seqs=2).worker_config()
    assert ModelRunner(c.model, config).kernels is None


def test_padding_non_128_shapes_is_exact():
    gen = torch.Generator().manual_seed(0)
    # On a power-of-two grid per 32×32 block (as a dequantised checkpoint is), 2 binades apart.
    w = torch.randint(-8, 9, (96, 64), generator=gen).float() * 2.0**-6
    w[:32] *= 4
    q, scale, inexact = quantize_padded(w)
    assert q.shape == (128, 128) and scale.shape == (1, 1) and inexact == 0
    full = reference.dequantize_weight_block128(q, scale)
    assert torch.equal(full[:96, :64], w) and not full[96:].any() and not full[:, 64:].any()


def test_quantize_each_equals_quantizing_the_stack():
    """KernelMoE quantises expert by expert (memory); the result must be the whole stack's, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    stack = torch.randn(3, 200, 136, generator=gen) * torch.tensor([1.0, 1e-3, 40.0])[:, None, None]
    q, scale, inexact = quantize_each(3, lambda i: stack[i])
    want_q, want_scale, want_inexact = quantize_padded(stack)
    assert q.shape == (3, 256, 256) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(scale, want_scale) and inexact == want_inexact > 0


# ---------------------------------------------------------------- CPU: interpreted modules


def test_one_expert_meta_is_built_once_per_decode_size():
    cpu = torch.device("cpu")
    meta = one_expert_meta(5, 2, cpu)
    assert one_expert_meta(5, 2, cpu) is meta and one_expert_meta(5, 3, cpu) is not meta
    big = META_CACHE_MAX_TOKENS + 1
    assert one_expert_meta(big, 1, cpu) is not one_expert_meta(big, 1, cpu)  # prefill sizes: never kept
    assert meta["row_ids"].tolist() == [list(range(5))] * 2 and meta["counts"].tolist() == [5, 5]
    assert meta["slot_of"].tolist() == [[t, t] for t in range(5)] and meta["num_active"].tolist() == [2]


def test_fp8_linear_interpreted_matches_dequantised_reference():
    gen = torch.Generator().manual_seed(1)
    kernels = interpreted()
    w = torch.randn(96, 200, generator=gen) * 0.05
    x = torch.randn(2, 5, 200, generator=gen)
    lin, lin32 = KernelLinear(w, "fp8", kernels), KernelLinear(w, "fp32", kernels)
    with interpreter():
        y = lin(x)
    assert y.shape == (2, 5, 96) and y.dtype == torch.float32
    wq = reference.dequantize_weight_block128(lin.w[0], lin.w_scale[0])[:96, :200]
    xq = reference.dequantize_act(*reference.quantize_act(torch.nn.functional.pad(x, (0, 56))))[..., :200]
    assert _rel(y, xq @ wq.t()) < tol.FP32_REORDER_REL  # the kernel's own formats: fp32 summation order only
    assert _rel(y, x @ w.t()) < tol.FP8_LINEAR_REL  # FP8 weights and activations vs fp32
    assert torch.equal(lin32(x), torch.nn.functional.linear(x, w))
    # Up to 16 rows on a projection with few N tiles, the split-K kernel runs, not the grouped GEMM.
    calls = []
    grouped = kernels.moe_grouped_gemm.moe_grouped_gemm
    with pytest.MonkeyPatch.context() as m:
        m.setattr(kernels.moe_grouped_gemm, "moe_grouped_gemm", lambda *a, **k: calls.append(1) or grouped(*a, **k))
        with interpreter():
            assert torch.equal(lin(x), y)
            lin(torch.randn(17, 200, generator=gen))
    assert calls == [1]  # only the 17-row call
    # Above 256 tokens (prefill) the tile is 32 tokens: the same rows, bit for bit, as 16-token tiles.
    assert (linear_block_m(256), linear_block_m(300)) == (16, 32)
    x_long = torch.randn(300, 200, generator=gen)
    with interpreter():
        y_long = lin(x_long)
        y_rows = torch.cat([lin(x_long[i : i + 100]) for i in range(0, 300, 100)])  # 16-token tiles
    assert torch.equal(y_long, y_rows)
    # wo_a: G groups of [R, Kg]; x [..., G, Kg] → [..., G·R]
    wo = torch.randn(2 * 16, 128, generator=gen) * 0.05
    xg = torch.randn(7, 2, 128, generator=gen)
    grouped = GroupedKernelLinear(wo, 2, "fp8", kernels)
    with interpreter():
        yg = grouped(xg)
    ref = torch.einsum("tgi,gri->tgr", xg, wo.view(2, 16, 128)).flatten(-2)
    assert yg.shape == (7, 32) and _rel(yg, ref) < tol.FP8_LINEAR_REL
    # Group g's rows are gathered from x's [T·G, Kg] rows in place: the same bits as the transposed
    # [G, T, Kg] copy's GEMM (per-row quantisation, the same products in the same K order).
    with interpreter():
        q, s = kernels.quant_fp8.quantize_act(xg.transpose(0, 1).reshape(14, 128))
        copied = kernels.moe_grouped_gemm.moe_grouped_gemm(
            (q.view(2, 7, 128), s.view(2, 7, 1)),
            grouped.w,
            grouped.w_scale,
            one_expert_meta(7, 2, xg.device),
            gather=False,
            out_dtype=torch.float32,
            block_m=16,
            num_warps=4,
        )
    assert torch.equal(yg, copied[:, :, :16].transpose(0, 1).reshape(7, 32))
    meta = group_rows_meta(3, 2, xg.device)
    assert meta["row_ids"].tolist() == [[0, 2, 4], [1, 3, 5]] and group_rows_meta(3, 2, xg.device) is meta
    # fp32 torch on both sides over K = 128: two orders differ by ≈ √(2K)·u32 = 9.5e-7 relative.
    assert _rel(GroupedKernelLinear(wo, 2, "fp32", kernels)(xg), ref) < 1e-6


@pytest.mark.parametrize("precision", ["fp8", "fp32"])
def test_kernel_moe_interpreted_matches_model_moe(precision):
    c = case("oracle")
    moe = c.model.layers[3].ffn
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 13, c.model.cfg.hidden_size, generator=gen)
    counts_ref = torch.zeros(moe.w1.shape[0], dtype=torch.long)
    counts = torch.zeros_like(counts_ref)
    with torch.no_grad():
        ref = moe(x, counts_ref)
    kmoe = KernelMoE(moe, precision, interpreted())
    with interpreter():
        out = kmoe(x, counts)
    assert torch.equal(counts, counts_ref)  # same routing, counted like the model
    if precision == "fp32":
        assert _rel(out, ref) < tol.FP32_REORDER_REL
        return
    # The kernels' own formats (e4m3 x and h, 128×128 weights; reference.moe_experts on the same
    # routing with the shared expert as expert E): the down GEMM writes bf16, which the interpreter
    # truncates (< 2^-7 relative) where torch rounds to nearest. The model: FP8 error.
    weights, experts = reference.moe_router(x[0], moe.gate_weight, moe.gate_bias, moe.top_k, moe.route_scale)
    shared = torch.full((13, 1), moe.w1.shape[0])
    meta = reference.route_metadata(
        torch.cat((experts, shared), 1), torch.cat((weights, torch.ones(13, 1)), 1), moe.w1.shape[0] + 1
    )
    xp = torch.nn.functional.pad(x[0], (0, kmoe.w13.shape[-1] - x.shape[-1]))
    same = reference.moe_experts(xp, meta, kmoe.w13, kmoe.w13_scale, kmoe.w2, kmoe.w2_scale, moe.limit)
    assert _rel(out[0], same[:, : x.shape[-1]]) < tol.BF16_CAST_REL
    # Four e4m3 casts (x, w13, h, w2) of RMS relative error 3.25% each: √4 × 3.25% = 6.5%.
    assert _rel(out, ref) < 0.1


def _draft_blocks(precision: str, device: str = "cpu"):
    """A random model with a DSpark draft (small weights: an untrained draft's scale), its converted twin
    (interpreted kernels on CPU, compiled on CUDA) and both drafts' blocks from the same context and anchors
    (3 rows, 6 context positions; the torch draft on the CPU). Returns (model, twin, conversion, torch blocks,
    kernel blocks on the CPU)."""
    from model.deepseek_v41.dspark import DraftContext
    from model.deepseek_v41.model import DeepseekV41
    from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES, finish

    cfg = DRAFT_CASES[0].cfg
    cfg = finish(cfg, cfg.vocab_size)
    torch.manual_seed(3)
    model = DeepseekV41(cfg, list(range(cfg.vocab_size)), cfg.vocab_size)  # identity Engram map (unused here)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    twin = copy.deepcopy(model).to(device)
    done = convert_model(twin, precision, interpreted() if device == "cpu" else None)
    gen = torch.Generator().manual_seed(4)
    taps = torch.randn(3, 6, len(cfg.dspark_target_layer_ids) * cfg.hidden_size, generator=gen)
    anchors = torch.randint(3, cfg.vocab_size, (3,), generator=gen)
    blocks = {}
    with torch.no_grad(), interpreter() if device == "cpu" else contextlib.nullcontext():
        for name, m, on in (("torch", model, "cpu"), ("kernels", twin, device)):
            ctx = DraftContext.empty(m.draft, 3, on)
            ctx.append(m.draft, taps.to(on))
            out = m.draft.blocks_from_context(ctx, anchors.to(on), m.embed, m.head)
            blocks[name] = type(out)([t.cpu() for t in out.streams], out.hidden.cpu(), out.logits.cpu())
    return model, twin, done, blocks["torch"], blocks["kernels"]


def test_the_drafts_modules_take_the_kernels_and_draft_the_same_block():
    """The DSpark draft converts with the target: every norm → ``KernelRMSNorm``, every stage's mHC site →
    ``KernelHyperConnection``, its attention's FP8 projections → ``KernelLinear`` (``wo_a`` grouped), its MoE →
    ``KernelMoE``; ``main_proj``, the Markov head and the confidence projection stay torch. At fp32 the
    converted draft's block (stage streams, hidden, logits) from the same context and anchors equals the torch
    draft's within fp32 reordering, and its drafts are the same tokens."""
    model, twin, done, want, got = _draft_blocks("fp32")
    stages = len(model.draft.stages)
    assert done.draft_moes == stages and done.moes == model.cfg.num_hidden_layers + stages
    # Per stage: 4 norms (attn, ffn, q, kv), 2 mHC sites, 4 projections + wo_a, the MoE; then main_norm, norm
    # and the block attention.
    assert done.draft_modules == stages * 12 + 3 and done.draft_attentions == 1
    assert isinstance(twin.draft.block_attention, KernelDraftAttention)
    for s in twin.draft.stages:
        assert isinstance(s.ffn, KernelMoE) and isinstance(s.attn.wo_a, GroupedKernelLinear)
        assert all(isinstance(n, KernelRMSNorm) for n in (s.attn_norm, s.ffn_norm, s.attn.q_norm, s.attn.kv_norm))
        assert isinstance(s.hc_attn, KernelHyperConnection) and isinstance(s.hc_ffn, KernelHyperConnection)
        assert all(isinstance(getattr(s.attn, name), KernelLinear) for name in FP8_PROJECTIONS["Attention"])
    draft = twin.draft
    assert isinstance(draft.norm, KernelRMSNorm) and isinstance(draft.main_norm, KernelRMSNorm)
    assert all(type(m) is nn.Linear for m in (draft.main_proj, draft.markov_head, draft.confidence_proj))
    for a, b in zip(want.streams, got.streams):
        assert _rel(b, a) < tol.FP32_REORDER_REL
    assert _rel(got.hidden, want.hidden) < tol.FP32_REORDER_REL
    assert _rel(got.logits, want.logits) < tol.FP32_REORDER_REL
    assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))


def test_the_fp8_draft_stays_near_the_torch_draft():
    """At fp8 the draft's projections and experts round their inputs and weights to e4m3: its logits stay within
    the kernel MoE's FP8 bound of the torch draft's (test_kernel_moe_interpreted_matches_model_moe: a few e4m3 casts of
    3.25% RMS each)."""
    _, _, _, want, got = _draft_blocks("fp8")
    assert _rel(got.hidden, want.hidden) < 0.1
    assert _rel(got.logits, want.logits) < 0.1


# ---------------------------------------------------------------- CPU: the engine, interpreted


SMALL_PROMPTS = {"r0": 6, "r1": 5, "r2": 16}
"""Oracle config (ratio-2 source 2, ratio-1 source and candidate source 5, Reindex 4 and 7 inside the
candidates): at budget 10 the steps are [6, 4], [1, 9] (a one-row chunk among prefill rows), [7] (a
chunk at position 9 that overwrites ring positions, ring 14 − window 8 = 6 back, its first rows read)
and [1, 1, 1] (decode-only). r2 reaches 16 ratio-1 entries: past top-k 4 and the 4 candidate blocks of 2."""


def small_case() -> Case:
    """The oracle model on SMALL_PROMPTS. No rounding hook with it: a value within fp32 noise of an
    FP8/FP4 bin edge would flip (tokens from seed 5 put one in r0 at position 4: 2.7e-5 from there on
    in the interpreter); seed 7's have none there (≤ 3.5e-6)."""
    c = case("oracle")
    gen = torch.Generator().manual_seed(7)
    seqs = {
        rid: torch.randint(3, c.model.cfg.vocab_size, (n + MAX_TOKENS,), generator=gen).tolist()
        for rid, n in SMALL_PROMPTS.items()
    }
    return Case(c.model, seqs, None, {}, {})


def against_torch_runner(small: Case, runner: ModelRunner, context=contextlib.nullcontext) -> float:
    """Drive ``runner`` (every kernel; the entry pool never read back in torch) and the CPU torch runner
    on the same plans through the first decode-only step: max |Δ| of the logits over every position."""
    import services.worker.state.cache_engine as cache_engine

    torch_runner = ModelRunner(small.model, _config(small, 10))
    expected, shapes = {}, []

    def both(plan):
        shapes.append(plan.seqlens_q.tolist())
        want = torch_runner.execute(plan, all_rows=True)
        for row, (pos, i) in enumerate(zip(plan.positions.tolist(), plan.row_requests.tolist())):
            expected[(plan.request_ids[i], pos)] = want.logits[row]
        with context(), pytest.MonkeyPatch.context() as patch:
            patch.setattr(cache_engine.CacheEngine, "read_entries", _refuse("CacheEngine.read_entries"))
            return runner.execute(plan, all_rows=True)

    logits = drive(small, runner, 10, both, decode_steps=1)
    assert shapes == [[6, 4], [1, 9], [7], [1, 1, 1]]
    assert sum(isinstance(m, KernelHyperConnection) for m in runner.model.modules()) == 2 * len(runner.model.layers)
    worst = max(float((logits[key] - expected[key]).abs().max()) for key in expected)
    print(
        f"\nfp32 kernel engine ({runner.model.embed.weight.device}) vs torch runner: max |Δ| {worst:.3g} over "
        f"{len(expected)} positions"
    )
    return worst


def test_engine_fp32_interpreted_equals_torch_runner():
    """The whole kernel engine (fp32 weights, no rounding hook) under the interpreter against the torch
    runner on the same plans: mHC, compressor, indexer (candidates included), prefill and decode
    attention, norms, projections and MoE all on kernels, and no entry pool read back in torch."""
    small = small_case()
    runner = runner_for(small, copy.deepcopy(small.model), 10, "fp32", interpreted())
    assert against_torch_runner(small, runner, interpreter) <= tol.PREFIX_ATOL


def test_staged_prefill_entries_are_taken_and_change_nothing(monkeypatch):
    """Prefill attention on entries dequantised once per source (``TritonAttention._staged``) is taken at
    these sizes, and each of its outputs equals the in-loop dequantisation's on the same inputs (fp32
    keys under the interpreter: the same products; the online softmax's key blocks differ). Checked
    per call: the tiny model's logits barely depend on its compressed entries."""
    from services.worker.attention import triton_backend

    small = small_case()
    original = triton_backend.TritonAttention._prefill
    errors: list[float] = []

    def both_ways(self, attn, q, k):
        out = original(self, attn, q, k)
        if self._staged(attn) is not None:
            with monkeypatch.context() as m:
                m.setattr(triton_backend, "STAGE_MAX_ENTRIES", 0)
                errors.append(_rel(out, original(self, attn, q, k)))
        return out

    monkeypatch.setattr(triton_backend.TritonAttention, "_prefill", both_ways)
    runner = runner_for(small, copy.deepcopy(small.model), 10, "fp32", interpreted())
    with interpreter():
        drive(small, runner, 10)
    # Two prefill steps × six compressed layers; the same products over ≤ 16 keys split otherwise into
    # blocks: √(2K)·u32 ≤ 3.4e-7 relative at K = 16, and the bound is 3× that.
    assert len(errors) >= 12 and max(errors) < 1e-6, errors


def test_staged_prefill_window_is_taken_and_changes_nothing(monkeypatch):
    """Prefill attention on window keys dequantised once per layer and step (``TritonAttention._staged_window``)
    is taken on every prefill-attention call at these sizes, and each output is bit for bit the in-loop
    dequantisation's on the same inputs (STAGE_MAX_WINDOW_ROWS 0: the same call unstaged)."""
    from services.worker.attention import triton_backend

    small = small_case()
    prefill, staging = triton_backend.TritonAttention._prefill, triton_backend.TritonAttention._staged_window
    taken: list[bool] = []
    equal: list[bool] = []

    def recording(self, attn, step_k, ring):
        window = staging(self, attn, step_k, ring)
        taken.append(window is not None)
        return window

    def both_ways(self, attn, q, k):
        out = prefill(self, attn, q, k)
        with monkeypatch.context() as m:
            m.setattr(triton_backend, "STAGE_MAX_WINDOW_ROWS", 0)
            equal.append(torch.equal(out, prefill(self, attn, q, k)))
        return out

    monkeypatch.setattr(triton_backend.TritonAttention, "_staged_window", recording)
    monkeypatch.setattr(triton_backend.TritonAttention, "_prefill", both_ways)
    runner = runner_for(small, copy.deepcopy(small.model), 10, "fp32", interpreted())
    with interpreter():
        drive(small, runner, 10, decode_steps=1)  # steps of rows [6, 4], [1, 9], [7], then decode
    assert len(equal) == 3 * len(small.model.layers) and all(equal), equal  # every layer of the 3 prefill steps
    assert taken == [True, False] * len(equal)


def _config(c: Case, budget: int) -> WorkerConfig:
    n = len(c.seqs)
    return EngineConfig(
        block_size=BLOCK,
        num_blocks=64,
        num_state_slots=n + 1,
        max_num_seqs=n,
        max_num_batched_tokens=budget,
        max_model_len=128,
    ).worker_config()


def _refuse(what: str):
    def raising(*args, **kwargs):
        raise AssertionError(f"the torch reference {what} ran in a kernel step")

    return raising


def test_kernel_sampler_interpreted_equals_sampler_and_is_the_workers():
    """``KernelSampler`` gives the CPU sampler's output (greedy, top-k, top-p, bans, top-n logprobs);
    a kernel-backend runner's Worker samples with it; a batch asking more than 64 top logprobs is refused."""
    c = case("oracle")
    kernels = interpreted()
    worker = Worker(runner_for(c, copy.deepcopy(c.model), 16, "fp32", kernels))
    assert isinstance(worker.sampler, KernelSampler) and worker.sampler.kernel is kernels.sampler
    assert isinstance(Worker(ModelRunner(c.model, _config(c, 16))).sampler, Sampler)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(4, c.model.cfg.vocab_size, generator=gen) * 3
    rows = [
        SamplingRow(0.0, -1, 1.0, 1, 0, None, (), 3),
        SamplingRow(0.8, 20, 1.0, 2, 5, None, (7,), 0),
        SamplingRow(1.0, -1, 0.9, 3, 9, None, (), 2),
        SamplingRow(1.3, 8, 0.7, 4, 1, 12, (1, 2), 1),
    ]
    with interpreter():
        got = worker.sampler(logits, rows)
    want = Sampler()(logits, rows)
    assert torch.equal(got.token_ids, want.token_ids) and torch.equal(got.errors, want.errors)
    assert torch.equal(got.top_token_ids, want.top_token_ids)
    # A log-sum-exp in another order (tests/kernels/test_sampler.py's _check derives it).
    for name in ("logprobs", "top_logprobs"):
        torch.testing.assert_close(
            getattr(got, name), getattr(want, name), rtol=tol.FP32_REORDER_REL, atol=tol.FP32_REORDER_REL
        )
    with pytest.raises(ValueError, match="at most 64 top logprobs"):
        worker.sampler(logits[:1], [SamplingRow(1.0, -1, 1.0, 1, 0, None, (), 65)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        worker.sampler(logits[:1], [SamplingRow(1.0, -1, 1.0, 1, 0, None, (999,), 0)])


# ---------------------------------------------------------------- GPU


def _kl_report(c: Case, logits) -> dict[str, float]:
    kls, agree, margin_rows = [], 0, 0
    for b, (rid, s) in enumerate(c.seqs.items()):
        for pos in range(len(s) - 1):
            ref = c.reference[b, pos].cpu().double()
            ours = logits[(rid, pos)].double()
            p = ref.log_softmax(-1)
            kls.append(float((p.exp() * (p - ours.log_softmax(-1))).sum()))
            top2 = ref.topk(2).values
            if float(top2[0] - top2[1]) >= 0.05:
                margin_rows += 1
                agree += int(ref.argmax() == ours.argmax())
    return {
        "mean_kl": sum(kls) / len(kls),
        "max_kl": max(kls),
        "top1": agree / max(margin_rows, 1),
        "margin_rows": margin_rows,
        "positions": len(kls),
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "budget"), [("oracle", 7), ("wide", 5), ("nocand", 32)])
def test_gpu_fp32_engine_matches_cpu_reference(name, budget):
    torch.backends.cuda.matmul.allow_tf32 = False
    c = case(name)  # CPU model and its full-sequence reference
    model = copy.deepcopy(c.model).to("cuda")
    logits = drive(c, runner_for(c, model, budget, "fp32", rounding=cpu_rounding(c)), budget)
    worst, compared = worst_delta(c, logits)
    print(f"\nGPU fp32 kernel engine {name} budget {budget}: max |Δ| {worst:.3g} over {compared} positions")
    assert worst <= tol.LOGITS_ATOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp32_engine_every_kernel_matches_torch_runner():
    """The rounding hook above keeps compression and selection in torch; here nothing does: every kernel
    compiled (fp32 weights) against the CPU torch runner on the same plans (the interpreted test's)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    small = small_case()
    runner = runner_for(small, copy.deepcopy(small.model).to("cuda"), 10, "fp32")
    assert against_torch_runner(small, runner) <= tol.LOGITS_ATOL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_converted_draft_matches_the_cpu_torch_draft():
    """The DSpark draft on the compiled kernels (norms, mHC, FP8-path projections, MoE): at fp32 its block's
    logits within the engine's logits tolerance of the CPU torch draft's, at fp8 within the CPU test's bound."""
    torch.backends.cuda.matmul.allow_tf32 = False
    _, _, _, want, got = _draft_blocks("fp32", "cuda")
    worst = float((got.logits - want.logits).abs().max())
    print(f"\nGPU fp32 converted draft: max |Δ logits| {worst:.3g}, rel {_rel(got.logits, want.logits):.3g}")
    assert worst <= tol.LOGITS_ATOL
    _, _, _, want, got = _draft_blocks("fp8", "cuda")
    print(f"GPU fp8 converted draft: rel {_rel(got.logits, want.logits):.3g}")
    assert _rel(got.hidden, want.hidden) < 0.1 and _rel(got.logits, want.logits) < 0.1


FP8_CASES = (("oracle", 16), ("wide", 23), ("nocand", 32))


def _fp8_reports(device: str, kernels: KernelSet | None) -> dict[str, float]:
    """KL(reference ‖ FP8 engine) and top-1 agreement over every position of the three configs."""
    reports = []
    for name, budget in FP8_CASES:
        c = case(name)
        logits = drive(c, runner_for(c, copy.deepcopy(c.model).to(device), budget, "fp8", kernels), budget)
        reports.append(_kl_report(c, logits))
    positions = sum(r["positions"] for r in reports)
    margin_rows = sum(r["margin_rows"] for r in reports)
    return {
        "mean_kl": sum(r["mean_kl"] * r["positions"] for r in reports) / positions,
        "max_kl": max(r["max_kl"] for r in reports),
        "top1": sum(r["top1"] * r["margin_rows"] for r in reports) / margin_rows,
        "margin_rows": margin_rows,
        "positions": positions,
    }


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_engine_kl_and_top1_against_cpu_reference():
    """FP8 weights and activations on the GPU vs the CPU fp32 reference, every position of every prompt
    of the three configs (chunked prefill and decode). The FP8 accuracy targets ask for mean KL ≤ 1e-3, max ≤ 1e-2 and
    top-1 ≥ 99% where the reference's top-2 margin is ≥ 0.05; on these random tiny models the FP8
    formats alone miss that by far (the same wiring on the torch references, on the CPU: mean KL ~0.07;
    even bf16 inputs to the attention projections alone give 0.04: the indexer top-k, candidate
    blocks, MoE routing and cache rounding turn small perturbations into discrete flips). So the
    kernels are held to that format floor: no worse than twice its KL, top-1 within 10 points."""
    gpu_fp8 = _fp8_reports("cuda", None)
    floor = _fp8_reports("cpu", KernelSet.references())
    print(f"\nGPU fp8 kernel engine: {gpu_fp8}\nCPU FP8-format floor (torch references): {floor}")
    print(
        f"FP8 accuracy targets met: mean KL ≤ 1e-3 {gpu_fp8['mean_kl'] <= 1e-3}, max KL ≤ 1e-2 "
        f"{gpu_fp8['max_kl'] <= 1e-2}, top-1 ≥ 0.99 {gpu_fp8['top1'] >= 0.99}"
    )
    assert gpu_fp8["mean_kl"] <= max(1e-3, 2 * floor["mean_kl"])
    assert gpu_fp8["max_kl"] <= max(1e-2, 2 * floor["max_kl"])
    assert gpu_fp8["top1"] >= min(0.99, floor["top1"] - 0.1)


REFERENCES = (
    "rmsnorm",
    "quantize_act",
    "dequantize_act",
    "moe_router",
    "moe_grouped_gemm",
    "moe_experts",
    "moe_combine",
    "sparse_decode_attention",
    "sparse_prefill_attention",
    "indexer_select",
    "dequantize_weight_block128",
)
"""kernels.reference's oracles (route_metadata and entry_slots are the kernels' own graph-safe glue)."""

STEP_KERNELS = {
    "_rmsnorm_kernel",
    "_router_kernel",
    "_layout_kernel",
    "_compress_kernel",
    "_score_kernel",
    "_select_kernel",
    "_mix_kernel",
    "_expand_kernel",
    "_collapse_kernel",
    "_engram_gate_kernel",
}
"""Every step's Triton kernels (fp32 weights: the experts and projections are torch matmuls, there is
no fp32-weight GEMM kernel; fp8 adds ``_moe_gemm_kernel``, and ``_quantize_act_kernel`` only where a GEMM
has more than ``quant_fp8.IN_GEMM_MAX_ROWS`` rows: fewer are quantised inside the GEMMs)."""


def _refusing_patches(patch: pytest.MonkeyPatch) -> None:
    """Every torch reference the kernel backend replaces raises if called."""
    import model.deepseek_v41.attention as attention
    import model.deepseek_v41.mhc as mhc
    import services.worker.attention.torch_backend as torch_backend
    import services.worker.runners.model_runner as model_runner
    import services.worker.state.cache_engine as cache_engine
    from model.deepseek_v41.moe import MoE as ModelMoE
    from services.worker.sampling.sampler import Sampler as CpuSampler

    for fn in REFERENCES:
        patch.setattr(reference, fn, _refuse(f"kernels.reference.{fn}"))
    patch.setattr(RMSNorm, "forward", _refuse("RMSNorm.forward"))
    patch.setattr(ModelMoE, "forward", _refuse("MoE.forward"))
    patch.setattr(attention.Attention, "project_out", _refuse("Attention.project_out"))
    for module in (attention, torch_backend):
        patch.setattr(module, "sink_attention", _refuse("sink_attention"))
    for method in ("compress", "write_groups", "select"):
        patch.setattr(torch_backend.TorchAttention, method, _refuse(f"TorchAttention.{method}"))
    patch.setattr(cache_engine.CacheEngine, "read_entries", _refuse("CacheEngine.read_entries"))
    patch.setattr(mhc.HyperConnection, "forward", _refuse("HyperConnection.forward"))
    patch.setattr(Engram, "forward", _refuse("Engram.forward"))
    for fn in ("collapse", "expand", "sinkhorn"):
        patch.setattr(mhc, fn, _refuse(f"model mhc.{fn}"))
    patch.setattr(model_runner, "collapse", _refuse("model mhc.collapse (final)"))
    patch.setattr(CpuSampler, "__call__", _refuse("Sampler.__call__"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("precision", ["fp8", "fp32"])
def test_gpu_steps_run_the_triton_kernels_and_no_torch_reference(precision, monkeypatch):
    """Profile the first step (prefill chunks, first position 0) and the first decode-only step, each
    through the Worker (model runner + KernelSampler): the Triton kernels are listed by name, and the
    torch references they replace (kernels.reference, the model's RMSNorm / MoE / mHC / sink attention /
    output projection, TorchAttention's compression and selection, the entry pool read-back, the CPU
    sampler) would raise if any ran."""
    from torch.profiler import ProfilerActivity, profile

    c = case("oracle")
    runner = runner_for(c, copy.deepcopy(c.model).to("cuda"), 64, precision)
    worker = Worker(runner)
    assert isinstance(worker.sampler, KernelSampler)
    names: dict[str, set[str]] = {}

    def on_plan(plan):
        kind = "decode" if all(n == 1 for n in plan.seqlens_q.tolist()) else "prefill"
        if kind in names or (kind == "prefill" and plan.seqlens_k.tolist() != plan.seqlens_q.tolist()):
            return runner.execute(plan, all_rows=True)
        rows = [SamplingRow(0.8, -1, 0.9, 7 + i, 0, None, (), 2) for i in range(sum(plan.num_sample_rows.tolist()))]
        # Warm-up: every kernel compiled before profiling. A step's pool writes depend only on its
        # inputs, and its reads of a request's state are of positions it does not write (a first step
        # reads no state; a decode step's ratio-2 partial row is not its own write): running the same
        # step again gives the same result.
        worker.execute(plan, rows)
        with monkeypatch.context() as patch:
            _refusing_patches(patch)
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                worker.execute(plan, rows)
                out = runner.execute(plan, all_rows=True)
                torch.cuda.synchronize()
        names[kind] = {e.name for e in prof.events()}
        if os.environ.get("KERNEL_BACKEND_PROFILE_DIR"):  # the whole table, for a report
            table = prof.key_averages().table(sort_by="device_time_total", row_limit=80)
            with open(os.path.join(os.environ["KERNEL_BACKEND_PROFILE_DIR"], f"{kind}_{precision}.txt"), "w") as f:
                f.write(table)
        return out

    drive(c, runner, 64, on_plan)
    assert set(names) == {"prefill", "decode"}, "no first prefill step or no decode-only step ran"
    common = STEP_KERNELS | ({"_moe_gemm_kernel"} if precision == "fp8" else set())
    expected = {
        "prefill": common | {"_prefill_attention_kernel", "_stage_window_kernel"},
        "decode": common | {"_decode_attention_kernel", "_sampler_kernel"},
    }
    for kind, seen in names.items():
        triton = sorted({n for n in seen if n.startswith("_") and n.endswith("kernel")})
        print(f"\n{precision} {kind} step kernels: {triton}")
        assert {k for k in expected[kind] if any(k in n for n in seen)} == expected[kind], kind
