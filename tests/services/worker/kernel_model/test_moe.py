"""KernelMoE's live-row mask (services/worker/kernel_model/moe.py), the static decode step's placeholder rows:
rows outside the mask are routed nowhere (no slot, no expert, no count) and come out as zeros, and the
live rows' outputs and counts are those of a call on the live rows alone. Interpreted on CPU (fp8: the
grouped GEMM kernel; fp32: the torch twin of the masked layout); on a GPU the compiled kernels at a
V41 Flash-sized layer with half the rows dead.

Its image mask: image-span tokens select their experts with the gate's ``bias_vl`` (model/deepseek_v41/moe.py),
as a module and through the whole kernel engine on a prompt with an image. The vision model's random
``bias_vl`` is independent of its ``gate_bias`` (0.3·N(0, 1) each), so a router that ignored the mask would
pick other experts for image tokens and these checks fail (checked by dropping the mask in ``KernelMoE``)."""

from __future__ import annotations

import copy
import dataclasses
from types import SimpleNamespace

import pytest
import torch

from kernels import invariance
from kernels.interpret import interpreter, load_interpreted
from kernels.reference import GROUP, dequantize_weight_block128
from model.batch_invariant import batch_invariant
from model.deepseek_v41.init import random_checkpoint
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.tokenizer import engram_token_map
from model.deepseek_v41.vision import span_length, span_rows_cols
from scheduler_rs import Scheduler, SchedulerConfig
from services.engine.config import EngineConfig
from services.worker.kernel_model import block_scaled_experts, block_scaled_gemm
from services.worker.kernel_model import moe as kernel_moe
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.moe import KernelMoE
from services.worker.runners.model_runner import ModelRunner
from tests import tolerances
from tests.model.deepseek_v41.oracle_configs import VISION_CASES, finish
from tests.model.deepseek_v41.oracle_harness import toy_tokenizer
from tests.scheduler_rs.fake_worker import run_step
from tests.services.worker.runners.test_model_runner import case

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _moe_kernels() -> KernelSet:
    names = ("rmsnorm", "quant_fp8", "moe_router", "moe_grouped_gemm", "decode_attention")
    return KernelSet(*(load_interpreted(name) for name in names), interpreted=True)


def check_live_mask(moe: KernelMoE, x: torch.Tensor, live: torch.Tensor, tol: float) -> None:
    """x [1, T, D], live bool [T]: masked call vs the live rows alone."""
    num_experts = moe.num_experts
    counts, alone_counts = (torch.zeros(num_experts, dtype=torch.long, device=x.device) for _ in range(2))
    out = moe(x, counts, live=live)
    alone = moe(x[:, live], alone_counts)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert torch.equal(out[:, ~live], torch.zeros_like(out[:, ~live]))
    assert torch.equal(counts, alone_counts) and int(counts.sum()) == int(live.sum()) * moe.top_k
    torch.testing.assert_close(out[:, live].float(), alone.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(moe(x, None, live=torch.ones_like(live)).float(), moe(x).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_dead_rows_route_nowhere_interpreted(precision):
    model = case("oracle").model
    kernels = _moe_kernels()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, model.cfg.hidden_size, generator=gen)
    live = torch.tensor([True, True, False, True, False, True, True, False])
    with interpreter(), batch_invariant():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), precision, kernels)
        # Row-wise maths: only the GEMMs' row counts differ (fp32: bmm over other capacities, which the
        # batch-invariant mode sums in one order; fp8: the kernel's rows are independent), so bits agree.
        check_live_mask(moe, x, live, tol=0.0)
        # No live row at all (graph warm-up): every expert idle, zeros out.
        counts = torch.zeros(moe.num_experts, dtype=torch.long)
        out = moe(x, counts, live=torch.zeros_like(live))
        assert int(counts.sum()) == 0 and torch.equal(out, torch.zeros_like(out))


def test_decode_sizes_take_the_layout_kernel_and_match_the_torch_layout(monkeypatch):
    """Up to LAYOUT_MAX_TOKENS the layout is kernels/moe_layout.py's one launch; the torch layout gives
    the same outputs and counts (a kernel set without ``moe_layout``, e.g. the references, takes it)."""
    model = case("oracle").model
    x = torch.randn(1, 9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    live = torch.tensor([True, False, True, True, True, False, True, True, True])
    with interpreter():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), "fp8", _moe_kernels())
        results = []
        for kernel in (True, False):
            if kernel:
                monkeypatch.setattr(KernelMoE, "_layout", lambda *a: pytest.fail("took the torch layout"))
            else:
                monkeypatch.undo()
                monkeypatch.setattr(moe.kernels.moe_router, "LAYOUT_MAX_TOKENS", 0)
            counts = torch.zeros(moe.num_experts, dtype=torch.long)
            results.append((moe(x, counts, live=live), counts))
    (out_k, counts_k), (out_t, counts_t) = results
    assert torch.equal(out_k, out_t) and torch.equal(counts_k, counts_t) and int(counts_k.sum()) == 7 * moe.top_k


def test_the_shared_experts_own_launches_give_the_same_bits_with_dead_rows(monkeypatch):
    """``moe_experts`` launching the shared expert apart (forced here at 8 rows) or stacked: the same bits,
    with dead rows and with every row dead (no active expert: the routed launch's count is −1)."""
    model = case("oracle").model
    x = torch.randn(1, 8, model.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    live = torch.tensor([True, False, True, True, False, True, True, True])
    with interpreter():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), "fp8", _moe_kernels())
        results = []
        for apart in (True, False):
            monkeypatch.setattr(moe.kernels.moe_grouped_gemm, "shared_apart", lambda *a, apart=apart: apart)
            results.append((moe(x, live=live), moe(x, live=torch.zeros_like(live))))
    (apart, apart_dead), (one, one_dead) = results
    assert (
        torch.equal(apart, one) and torch.equal(apart_dead, torch.zeros_like(x)) and torch.equal(one_dead, apart_dead)
    )


def test_the_splitk_flag_takes_the_split_k_experts_where_the_rule_says_with_the_one_pass_bits(monkeypatch):
    """``SHINKAI_MOE_SPLITK=1`` (read when the module is built) sends decode to ``moe_experts_splitk`` where
    ``worth_splitting_experts`` says (kernels/moe_splitk.py), and only then. The oracle layer's K is one 128
    block: one split, whose sum 0 + p_0 is the one pass's bits, dead rows and all; the rule itself (shapes,
    the batch-invariant mode) is tested in tests/kernels/test_moe_splitk.py."""
    model = case("oracle").model
    x = torch.randn(1, 8, model.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    live = torch.tensor([True, False, True, True, False, True, True, True])
    with interpreter():
        off = KernelMoE(copy.deepcopy(model.layers[1].ffn), "fp8", _moe_kernels())
        monkeypatch.setenv("SHINKAI_MOE_SPLITK", "1")
        on = KernelMoE(copy.deepcopy(model.layers[1].ffn), "fp8", _moe_kernels())
        assert (off.splitk, on.splitk) == (False, True)
        gemm = on.kernels.moe_grouped_gemm
        layout = {"row_ids": torch.empty(on.num_experts + 1, 8), "slot_of": torch.empty(8, on.top_k + 1)}
        assert not gemm.worth_splitting_experts(layout, on.w13, on.w2)  # one K block: nothing to split
        one = off(x, live=live)
        monkeypatch.setattr(gemm, "worth_splitting_experts", lambda *a: True)
        monkeypatch.setattr(gemm, "moe_experts", lambda *a, **k: pytest.fail("took the one pass"))
        split = on(x, live=live)
    assert torch.equal(split, one)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_long_steps_run_in_passes_with_the_same_rows(precision, monkeypatch):
    """Above MOE_MAX_TOKENS the tokens go through in passes (prefill memory): the same outputs and
    counts as one pass, with and without a live mask."""
    model = case("oracle").model
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 8, model.cfg.hidden_size, generator=gen)
    live = torch.tensor([True, False, True, True, False, True, True, True])
    with interpreter(), batch_invariant():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), precision, _moe_kernels())
        results = []
        for max_tokens in (8, 3):  # one pass; passes of 3, 3 and 2 tokens
            monkeypatch.setattr(kernel_moe, "MOE_MAX_TOKENS", max_tokens)
            counts = torch.zeros(moe.num_experts, dtype=torch.long)
            masked_counts = torch.zeros(moe.num_experts, dtype=torch.long)
            results.append((moe(x, counts), counts, moe(x, masked_counts, live=live), masked_counts))
    (one, one_counts, one_masked, one_masked_counts), (passes, counts, masked, masked_counts) = results
    assert passes.shape == x.shape and torch.equal(counts, one_counts)
    assert torch.equal(masked_counts, one_masked_counts) and int(masked_counts.sum()) == 6 * moe.top_k
    # fp8: the kernel's rows are independent; fp32: bmm over other capacities, one order in the mode.
    assert torch.equal(passes, one) and torch.equal(masked, one_masked)
    assert torch.equal(masked[:, ~live], torch.zeros_like(masked[:, ~live]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dead_rows_route_nowhere_flash_layer():
    """A v41-s1 MoE layer (Flash shapes: D 5120, I 2304, top-6; 48 experts + shared), 64 rows, ~half
    dead: the live rows equal a call on them alone up to the FP8 GEMM's per-expert row grouping."""
    from model.deepseek_v41.presets import V41_S1

    kmoe = flash_kernel_moe()
    with torch.device("cuda"):
        x = torch.randn(1, 64, V41_S1.hidden_size, dtype=torch.bfloat16)
        live = torch.rand(64) < 0.55
    check_live_mask(kmoe, x, live, tol=2e-2)  # bf16 outputs: 2^-7 relative per rounding


# ---------------------------------------------------------------- prefill experts through cuBLASLt


def _emulated_matmul(
    a: tuple[torch.Tensor, torch.Tensor],
    w: torch.Tensor,
    w_scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``block_scaled_gemm.matmul`` on the CPU: the fp32 product of the dequantised operands (what cuBLASLt
    computes, up to summation order), in ``out_dtype``; the weight scales read back from cuBLASLt's layout."""
    q, s = a
    w_scale = w_scale_b.t()[:, : w.shape[1] // GROUP]  # [K_blocks, N/128] → [N/128, K/128]
    return ((q.float() * s.repeat_interleave(GROUP, dim=1)) @ dequantize_weight_block128(w, w_scale).t()).to(out_dtype)


@pytest.fixture
def emulated_cublas(monkeypatch) -> list[int]:
    """The block-scaled path on the CPU: ``available`` holds, ``matmul`` is the emulation (its calls counted),
    and the thresholds are 8 tokens and 1 routed row per expert, so the tiny layer's steps take it."""
    calls: list[int] = []
    monkeypatch.setattr(block_scaled_gemm, "available", lambda device, out_dtype=torch.bfloat16: True)
    monkeypatch.setattr(
        block_scaled_gemm, "matmul", lambda a, *rest: calls.append(a[0].shape[0]) or _emulated_matmul(a, *rest)
    )
    monkeypatch.setattr(block_scaled_gemm, "MIN_TOKENS", 8)
    monkeypatch.setattr(block_scaled_experts, "MIN_ROWS_PER_EXPERT", 1)
    return calls


def _compiled_like_kernels() -> KernelSet:
    """The interpreted kernels as a compiled set (``interpreted`` False): the cuBLASLt and DeepGEMM paths'
    dispatch sees a GPU's kernel set, and their quantisation, layout and combine run interpreted."""
    return dataclasses.replace(_moe_kernels(), interpreted=False, moe_contiguous=load_interpreted("moe_contiguous"))


def test_prefill_steps_take_the_block_scaled_experts_and_agree_with_the_grouped_path(emulated_cublas):
    """From MIN_TOKENS rows (and MIN_ROWS_PER_EXPERT per expert) each active expert's gate/up and down products
    go through ``block_scaled_gemm.matmul`` on its own rows, padded to ``ROW_ALIGN`` (the shared expert on all of
    them); the output and
    the counts agree with the grouped Triton path's. Dead rows take no rows and come out as zeros."""
    model = case("oracle").model
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 12, model.cfg.hidden_size, generator=gen)
    live = torch.ones(12, dtype=torch.bool)
    live[[2, 9]] = False
    with interpreter():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), "fp8", _compiled_like_kernels())
        counts = torch.zeros(moe.num_experts, dtype=torch.long)
        got = moe(x, counts, live=live)
        calls = list(emulated_cublas)
        block_scaled_gemm.MIN_TOKENS = 13  # one row short: the grouped path
        grouped_counts = torch.zeros_like(counts)
        want = moe(x, grouped_counts, live=live)
        picks = moe.kernels.moe_router.moe_router(
            x[0, live].contiguous(), moe.gate_weight, moe.gate_bias, moe.top_k, moe.route_scale
        )[1]
    assert len(emulated_cublas) == len(calls)  # the grouped path made no call
    routed = torch.bincount(picks.flatten().long(), minlength=moe.num_experts)
    per_expert = [int(n) for n in routed if n] + [int(live.sum())]  # active routed experts in id order, then shared
    align = block_scaled_gemm.ROW_ALIGN  # each expert's rows padded to cuBLASLt's row multiple
    per_expert = [-(-n // align) * align for n in per_expert]
    assert calls == per_expert + per_expert  # gate/up for each, then down for each
    assert torch.equal(counts, grouped_counts) and torch.equal(counts, routed)
    assert torch.equal(got[:, ~live], torch.zeros_like(got[:, ~live]))
    # Both paths: the same e4m3 operands and scales, fp32 products; they differ in summation order, silu's
    # formula and the bf16 cast of the down output (the interpreter truncates, the emulation rounds to
    # nearest: one ulp at most, the BF16_TRUNC_REL derivation), and so in the rare e4m3 code of h that moves.
    rel = _rel(got, want)
    print(f"\nblock-scaled experts (emulated) vs the grouped Triton path: relative error {rel:.3g}")
    assert rel <= tolerances.BF16_TRUNC_REL


def test_the_block_scaled_experts_stay_out_of_the_mode_the_interpreter_and_small_steps(emulated_cublas):
    model = case("oracle").model
    x = torch.randn(1, 12, model.cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    ffn = model.layers[1].ffn
    with interpreter():
        KernelMoE(copy.deepcopy(ffn), "fp8", _moe_kernels())(x)  # the interpreted set
        with invariance.fixed_configs():  # the batch-invariant mode
            KernelMoE(copy.deepcopy(ffn), "fp8", _compiled_like_kernels())(x)
        block_scaled_experts.MIN_ROWS_PER_EXPERT = 12 * 6  # more rows per expert than the step has
        KernelMoE(copy.deepcopy(ffn), "fp8", _compiled_like_kernels())(x)
        assert emulated_cublas == []
        block_scaled_experts.MIN_ROWS_PER_EXPERT = 1
        KernelMoE(copy.deepcopy(ffn), "fp8", _compiled_like_kernels())(x)
    assert emulated_cublas  # the same step outside all three takes it


# ---------------------------------------------------------------- experts through DeepGEMM (where it imports)


def test_deepgemm_is_taken_where_it_is_available_and_nowhere_else(monkeypatch):
    """By default, with a passing probe, a compiled-like kernel set's fp8 experts run through
    ``kernels.deepgemm_moe`` (a torch stand-in for ``deep_gemm`` here) and agree with the grouped Triton path, the
    layout through the set's ``moe_contiguous``; with ``SHINKAI_MOE_GEMM=triton``, in the batch-invariant mode, with
    the interpreted set, or below ``MIN_TOKENS`` rows they stay on Triton. Dead rows come out as zeros either way."""
    from kernels import deepgemm_moe
    from tests.kernels.test_deepgemm_moe import fake_deep_gemm

    calls: list[tuple] = []
    real = deepgemm_moe.experts
    monkeypatch.setattr(deepgemm_moe, "module", lambda: fake_deep_gemm(4))
    monkeypatch.setattr(deepgemm_moe, "available", lambda device: True)
    monkeypatch.setattr(
        deepgemm_moe, "experts", lambda *a, **kw: calls.append((kw["masked"], kw["layout"])) or real(*a, **kw)
    )
    monkeypatch.setattr(block_scaled_experts, "applies", lambda *a: False)
    model = case("oracle").model
    x = torch.randn(1, 12, model.cfg.hidden_size, generator=torch.Generator().manual_seed(9))
    live = torch.ones(12, dtype=torch.bool)
    live[[3, 7]] = False
    ffn = model.layers[1].ffn
    with interpreter():
        monkeypatch.setenv(deepgemm_moe.ENV, "triton")
        want = KernelMoE(copy.deepcopy(ffn), "fp8", _compiled_like_kernels())(x, live=live)
        monkeypatch.delenv(deepgemm_moe.ENV, raising=False)  # on by default
        KernelMoE(copy.deepcopy(ffn), "fp8", _moe_kernels())(x)  # the interpreted set
        with invariance.fixed_configs():  # the batch-invariant mode
            KernelMoE(copy.deepcopy(ffn), "fp8", _compiled_like_kernels())(x)
        monkeypatch.setattr(deepgemm_moe, "MIN_TOKENS", 13)  # one row more than the step has
        KernelMoE(copy.deepcopy(ffn), "fp8", _compiled_like_kernels())(x)
        assert calls == []
        monkeypatch.setattr(deepgemm_moe, "MIN_TOKENS", 12)
        got = KernelMoE(copy.deepcopy(ffn), "fp8", _compiled_like_kernels())(x, live=live)
    layout = _compiled_like_kernels().moe_contiguous.contiguous_layout
    assert calls == [(False, layout)]  # eager: the contiguous layout, the kernel set's
    assert torch.equal(got[:, ~live], torch.zeros_like(got[:, ~live]))
    # The same e4m3 operands; DeepGEMM's path rounds gate/up to bf16 before the SwiGLU (Triton's epilogue keeps
    # fp32), moving the rare e4m3 code of h, and writes bf16 down outputs: within one FP8 cast's error.
    rel = _rel(got, want)
    print(f"\nDeepGEMM path (stand-in) vs the grouped Triton path: relative error {rel:.3g}")
    assert rel <= tolerances.FP8_LINEAR_REL


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a compute capability 9.x GPU (H100/H200)",
)
def test_gpu_block_scaled_experts_agree_with_the_grouped_path_on_a_flash_layer(monkeypatch):
    """A v41-s1 MoE layer (D 5120, I 2304, 48 experts top-6 + shared) at 4,096 tokens, 512 routed rows per
    expert: cuBLASLt's path is taken (two products per active expert) and agrees with the grouped Triton
    path. Bound: each down output is cast to bf16 by both (round to nearest, ≤ 2^-8 relative each); Hopper's
    FP8 MMA sums each 128-deep step in fewer bits than fp32 (1.9e-4 relative measured, test_moe_grouped_gemm),
    which moves an e4m3 code of h where it lies that close to a rounding boundary: PROBE_REL (2^-7) per path,
    test_block_scaled_gemm's bound against the exact product, twice for the two paths."""
    from model.deepseek_v41.presets import V41_S1

    kmoe = flash_kernel_moe()
    with torch.device("cuda"):
        x = torch.randn(1, 4096, V41_S1.hidden_size, dtype=torch.bfloat16)
    monkeypatch.setattr(block_scaled_experts, "MIN_ROWS_PER_EXPERT", 512)  # the path at 4K (the engine's is 16K)
    assert block_scaled_experts.applies(4096, kmoe.top_k, kmoe.num_experts, x.device, False)
    calls = []
    real = block_scaled_gemm.matmul
    monkeypatch.setattr(block_scaled_gemm, "matmul", lambda *a: calls.append(1) or real(*a))
    counts = torch.zeros(kmoe.num_experts, dtype=torch.long, device="cuda")
    got = kmoe(x, counts)
    assert len(calls) == 2 * (int((counts > 0).sum()) + 1)
    monkeypatch.setattr(block_scaled_experts, "applies", lambda *a: False)
    want = kmoe(x)
    rel = _rel(got, want)
    print(f"\nv41-s1 MoE layer, 4096 tokens: cuBLASLt per expert vs grouped Triton, relative error {rel:.3g}")
    assert rel <= 2 * block_scaled_gemm.PROBE_REL


# ---------------------------------------------------------------- the image mask (bias_vl)


def _all_kernels() -> KernelSet:
    return KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)


BLOCK, MAX_TOKENS, BUDGET = 16, 1, 64


@pytest.fixture(scope="module")
def vision_model() -> DeepseekV41:
    """vision-a's tower and layers, cut to 4 layers with each kind once (sliding window only; Engram with
    ratio-2 entries; ratio-1 entries with the indexer and candidates; sliding window), so every kernel of
    a step runs under the interpreter in half of the 8-layer model's time."""
    case = VISION_CASES[0]
    token_map, num = engram_token_map(toy_tokenizer(case.cfg.vocab_size))
    cfg = dataclasses.replace(
        case.cfg,
        num_hidden_layers=4,
        compress_ratios=(0, 2, 1, 0, 0),
        kv_source_layer_ids=(1, 2),
        index_source_layer_ids=(1, 2),
        candidate_source_layer_id=2,
        engram_layer_ids=(1,),
        engram_num_embeddings=(1,),
    )
    cfg = finish(cfg, num)
    model = DeepseekV41(cfg, token_map, num)
    assign_weights(model, random_checkpoint(cfg, case.seed))
    return model.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_kernel_moe_with_an_image_mask_routes_like_the_model(vision_model, precision):
    moe = vision_model.layers[1].ffn
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 19, vision_model.cfg.hidden_size, generator=gen)
    image = torch.zeros(1, 19, dtype=torch.bool)
    image[0, 3:12] = True
    counts_ref, counts_text = (torch.zeros(moe.w1.shape[0], dtype=torch.long) for _ in range(2))
    counts = torch.zeros_like(counts_ref)
    with torch.no_grad():
        ref = moe(x, counts_ref, image=image)
        moe(x, counts_text)
    kmoe = KernelMoE(moe, precision, _all_kernels())
    with interpreter():
        out = kmoe(x, counts, image=image)
    assert torch.equal(counts, counts_ref)  # the model's picks (bias_vl for the image rows), counted alike
    assert not torch.equal(counts_ref, counts_text)  # ... which the mask changed
    # fp32: only the summation order differs; fp8: four e4m3 casts, as test_kernel_backend.py's MoE check.
    assert _rel(out, ref) < (tolerances.FP32_REORDER_REL if precision == "fp32" else 0.1)


def _requests(model: DeepseekV41) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """request → prompt + one fed-back token, and the image request's span embeddings: short prompts, since
    every kernel runs under the interpreter (one image of 10 placeholders among 7 text tokens; text only)."""
    v = model.cfg.vision
    g = torch.Generator().manual_seed(8)

    def text(n: int) -> list[int]:
        return torch.randint(3, v.image_token_id, (n,), generator=g).tolist()

    grid = (5, 7)
    seqs = {
        "image": text(4)
        + [v.image_token_id] * span_length(*span_rows_cols(grid, v.downsample_ratio))
        + text(3)
        + text(MAX_TOKENS),
        "text": text(9) + text(MAX_TOKENS),
    }
    p = v.patch_size
    with torch.no_grad():
        patches = torch.rand(grid[0] * grid[1], 3, p, p, generator=g) * 2 - 1
        spans = {"image": torch.cat(model.encoder(patches, [grid]))}
    return seqs, spans


def _drive(
    runner: ModelRunner, model: DeepseekV41, seqs: dict[str, list[int]], spans: dict[str, torch.Tensor]
) -> tuple[dict[tuple[str, int], torch.Tensor], torch.Tensor]:
    """Every request through the real scheduler and ``runner`` (one prefill step: the budget holds every
    prompt): logits per (request, position) and the step's expert counts [layers, experts]."""
    cfg, n = model.cfg, len(seqs)
    ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    sched = Scheduler(
        SchedulerConfig(
            block_size=BLOCK,
            num_blocks=64,
            num_state_slots=n + 1,
            max_num_seqs=n,
            max_num_batched_tokens=BUDGET,
            max_model_len=128,
            window_size=cfg.sliding_window,
            compress_ratios=ratios,
        )
    )
    for rid, seq in seqs.items():
        if rid in spans:
            runner.set_images(rid, seq[:-MAX_TOKENS], spans[rid])
        sched.add_request(rid, seq[:-MAX_TOKENS], max_tokens=MAX_TOKENS, ignore_eos=True)
    plan = sched.schedule()
    assert plan.is_prefill and plan.num_rows == sum(len(seq) - MAX_TOKENS for seq in seqs.values())
    out = runner.execute(plan, all_rows=True)
    logits = {
        (plan.request_ids[i], pos): out.logits[row].float().cpu()
        for row, (pos, i) in enumerate(zip(plan.positions.tolist(), plan.row_requests.tolist()))
    }
    sched.update(plan, run_step(plan, lambda rid, pos: seqs[rid][pos]))
    for rid in seqs:
        sched.abort(rid)
        runner.release(rid)
    return logits, out.expert_counts.cpu()


def _runner(
    model: DeepseekV41, num_requests: int, backend: str, precision: str | None = None, kernels: KernelSet | None = None
) -> ModelRunner:
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=64,
        num_state_slots=num_requests + 1,
        max_num_seqs=num_requests,
        max_num_batched_tokens=BUDGET,
        max_model_len=128,
        batch_invariant=True,
    ).worker_config()
    return ModelRunner(copy.deepcopy(model), config, backend=backend, precision=precision, kernels=kernels)


def _kl(ours: dict, ref: dict) -> tuple[float, float]:
    """(mean, max) over positions of KL(reference ‖ ours)."""
    kls = []
    for key, r in ref.items():
        p = r.double().log_softmax(-1)
        kls.append(float((p.exp() * (p - ours[key].double().log_softmax(-1))).sum()))
    return sum(kls) / len(kls), max(kls)


def test_fp32_kernel_engine_with_an_image_equals_the_torch_backend(vision_model):
    """The whole kernel engine (fp32 weights, every kernel interpreted) on a batch of an image prompt and a
    text prompt, against the torch backend on the same plan: the same experts chosen in every layer
    (image tokens with ``bias_vl``) and the logits within summation-order noise, the existing fp32 engine
    bound (test_kernel_backend.py: ``PREFIX_ATOL``)."""
    seqs, spans = _requests(vision_model)
    want, want_counts = _drive(_runner(vision_model, 2, "torch"), vision_model, seqs, spans)
    with interpreter():
        got, counts = _drive(_runner(vision_model, 2, "kernels", "fp32", _all_kernels()), vision_model, seqs, spans)
    assert torch.equal(counts, want_counts)
    worst = max(float((got[key] - want[key]).abs().max()) for key in want)
    print(f"\nfp32 kernel engine with an image vs the torch backend: max |Δ| {worst:.3g} over {len(want)} positions")
    assert worst <= tolerances.PREFIX_ATOL


def test_fp8_kernel_engine_with_an_image_is_batch_invariant_and_within_the_fp8_floor(vision_model):
    """The FP8 kernel engine (interpreted, batch-invariant mode): the image prompt's logits alone equal its
    logits beside a text prompt (``==``), and against the torch backend they are as close as the FP8
    formats allow, by test_kernel_backend.py's FP8 bound: mean and max KL no worse than twice the same
    wiring's on the torch references (``KernelSet.references()``, the format floor), or the FP8 accuracy targets
    (docs/accuracy.md)."""
    seqs, spans = _requests(vision_model)
    want, _ = _drive(_runner(vision_model, 2, "torch"), vision_model, seqs, spans)
    floor, _ = _drive(_runner(vision_model, 2, "kernels", "fp8", KernelSet.references()), vision_model, seqs, spans)
    kernels = _all_kernels()
    with interpreter():
        batch, _ = _drive(_runner(vision_model, 2, "kernels", "fp8", kernels), vision_model, seqs, spans)
        alone, _ = _drive(
            _runner(vision_model, 1, "kernels", "fp8", kernels), vision_model, {"image": seqs["image"]}, spans
        )
    assert alone.keys() == {key for key in batch if key[0] == "image"}
    assert all(torch.equal(alone[key], batch[key]) for key in alone)
    (mean, worst), (floor_mean, floor_worst) = _kl(batch, want), _kl(floor, want)
    print(
        f"\nfp8 kernel engine with an image vs the torch backend: mean KL {mean:.3g}, max {worst:.3g}; "
        f"FP8-format floor {floor_mean:.3g}, {floor_worst:.3g}"
    )
    assert mean <= max(1e-3, 2 * floor_mean) and worst <= max(1e-2, 2 * floor_worst)


def test_rmsnorm_of_strided_rows_equals_that_of_their_copy():
    """``KernelRMSNorm`` hands the kernel rows at their stride (no contiguous copy first: one launch fewer per
    strided input in the decode step): the same bits as on the rows' contiguous copy, fp32 and bf16."""
    from model.deepseek_v41.norm import RMSNorm
    from services.worker.kernel_model.moe import KernelRMSNorm

    norm = RMSNorm(48, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(48, generator=torch.Generator().manual_seed(1)) + 0.5)
    kernels = SimpleNamespace(rmsnorm=load_interpreted("rmsnorm"))
    module = KernelRMSNorm(norm, kernels)
    for dtype in (torch.float32, torch.bfloat16):
        wide = torch.randn(3, 5, 2, 48, generator=torch.Generator().manual_seed(2)).to(dtype)
        x = wide[:, :, 1]  # [3, 5, 48]: rows 96 elements apart
        assert not x.is_contiguous()
        with interpreter(), torch.no_grad():
            got, want = module(x), module(x.contiguous())
        assert got.shape == x.shape and got.dtype == dtype and torch.equal(got, want)


def flash_kernel_moe() -> KernelMoE:
    """A v41-s1 MoE layer on CUDA with random weights (seed 0, the gate bias small), converted to FP8 kernels."""
    from model.deepseek_v41.moe import MoE
    from model.deepseek_v41.presets import V41_S1

    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(V41_S1)
        with torch.no_grad():
            for name, p in moe.named_parameters():
                p.normal_(0.0, 0.01 if name == "gate_bias" else p.shape[-1] ** -0.5)
        return KernelMoE(moe, "fp8", KernelSet.compiled())
