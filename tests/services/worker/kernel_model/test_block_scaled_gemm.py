"""services/worker/kernel_model/block_scaled_gemm.py: cuBLASLt's block-scaled GEMM for prefill's dense FP8 products.

On CPU: the weight scales' cuBLASLt layout, and that nothing but a Hopper GPU takes the path. On an H200
(``gpu``): the probe passes, the product agrees with the fp32 product of the same e4m3 operands and scales
as closely as the Triton GEMM does, and ``KernelLinear`` takes it from ``LINEAR_MIN_TOKENS`` rows."""

from __future__ import annotations

import pytest
import torch

from kernels.reference import GROUP, dequantize_weight_block128
from services.worker.kernel_model import block_scaled_gemm
from services.worker.kernel_model.block_scaled_gemm import PROBE_REL
from tests.tolerances import FP32_REORDER_REL


def test_scale_b_is_k_major_padded_to_four_k_blocks_with_ones():
    w_scale = torch.exp2(torch.randint(-9, 3, (3, 5)).float())  # N/128 = 3, K/128 = 5 → K_blocks 8
    s = block_scaled_gemm.scale_b(w_scale)
    assert s.shape == (8, 3) and s.stride() == (1, 8)
    assert torch.equal(s[:5], w_scale.t()) and torch.equal(s[5:], torch.ones(3, 3))
    even = block_scaled_gemm.scale_b(w_scale[:, :4])  # K/128 = 4: no padding
    assert even.shape == (4, 3) and even.stride() == (1, 4) and torch.equal(even, w_scale[:, :4].t())


def test_matmul_hands_cublas_a_multiple_of_four_rows_and_cuts_the_output_back(monkeypatch):
    """Row counts that are not a multiple of ``ROW_ALIGN`` are padded with zero rows (scale 1) for the call
    (``F.scaled_mm`` replaced by a CPU product that checks the operands' layouts) and the pad rows dropped."""
    seen = []

    def scaled_mm(q, w_t, s, recipe_a, w_scale_b, recipe_b, output_dtype):
        assert s.stride() == (1, q.shape[0]) and w_scale_b.stride() == (1, w_scale_b.shape[0])
        seen.append(q.shape[0])
        return ((q.float() * s.repeat_interleave(GROUP, dim=1)) @ w_t.float()).to(output_dtype)

    monkeypatch.setattr(block_scaled_gemm.F, "scaled_mm", scaled_mm)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(256, 384, generator=gen).to(torch.float8_e4m3fn)
    w_scale_b = block_scaled_gemm.scale_b(torch.ones(2, 3))
    for m in (8, 7, 5):
        q = torch.randn(m, 384, generator=gen).to(torch.float8_e4m3fn)
        s = torch.exp2(torch.randint(-3, 3, (m, 3), generator=gen).float())
        out = block_scaled_gemm.matmul((q, s), w, w_scale_b, torch.float32)
        assert out.shape == (m, 256) and out.is_contiguous()
        want = (q.float() * s.repeat_interleave(GROUP, dim=1)) @ w.float().t()
        assert _rel(out, want) <= FP32_REORDER_REL  # the same product over more rows: at most reordered
    assert seen == [8, 8, 8]


def test_grouped_wo_a_takes_one_block_scaled_gemm_a_group_and_agrees_with_the_grouped_gemm(monkeypatch):
    """``GroupedKernelLinear`` (attention's wo_a) from ``GROUPED_MIN_TOKENS`` tokens (lowered to 64 here): each
    group's rows handed to cuBLASLt contiguous with M-major scales (``F.scaled_mm`` replaced by a CPU product
    that checks the layouts and applies both operands' block scales), one call a group, and the result the
    interpreted Triton grouped GEMM's (the path below the threshold) up to fp32 summation order: the same e4m3
    values and scales."""
    from dataclasses import replace

    from kernels.interpret import interpreter, load_interpreted
    from services.worker.kernel_model.fp8_linear import GroupedKernelLinear
    from services.worker.kernel_model.kernel_set import KernelSet

    calls = []

    def scaled_mm(q, w_t, s, recipe_a, w_scale_b, recipe_b, output_dtype):
        assert q.is_contiguous() and s.stride() == (1, q.shape[0]) and w_scale_b.stride() == (1, w_scale_b.shape[0])
        k, n = w_t.shape
        w_scale = w_scale_b[: k // GROUP].repeat_interleave(GROUP, 0).repeat_interleave(GROUP, 1)[:, :n]
        calls.append(q.shape[0])
        return ((q.float() * s.repeat_interleave(GROUP, dim=1)) @ (w_t.float() * w_scale)).to(output_dtype)

    monkeypatch.setattr(block_scaled_gemm.F, "scaled_mm", scaled_mm)
    monkeypatch.setattr(block_scaled_gemm, "available", lambda device, out_dtype=torch.bfloat16: True)
    monkeypatch.setattr(block_scaled_gemm, "GROUPED_MIN_TOKENS", 64)
    names = ("rmsnorm", "quant_fp8", "moe_router", "moe_grouped_gemm", "decode_attention")
    triton = KernelSet(*(load_interpreted(name) for name in names), interpreted=True)
    gen = torch.Generator().manual_seed(2)
    groups, rank, width = 2, 128, 256
    weight = torch.randn(groups * rank, width, generator=gen) * torch.logspace(
        -2, 2, width // GROUP, base=2.0
    ).repeat_interleave(GROUP)
    below = GroupedKernelLinear(weight, groups, "fp8", triton)
    above = GroupedKernelLinear(weight, groups, "fp8", replace(triton, interpreted=False))  # may take cuBLASLt
    num_tokens = block_scaled_gemm.GROUPED_MIN_TOKENS + 2  # not a multiple of ROW_ALIGN: padded for the call
    x = torch.randn(num_tokens, groups, width, generator=gen)  # [T, G, Kg]
    with interpreter():
        got = above(x)
        want = below(x)
        short = above(x[:-3])  # GROUPED_MIN_TOKENS - 1 tokens: the grouped GEMM
    assert calls == [num_tokens + 2] * groups
    assert got.shape == want.shape == (num_tokens, groups * rank) and got.dtype == torch.float32
    assert _rel(got, want) <= FP32_REORDER_REL
    assert len(calls) == groups and torch.equal(short, want[:-3])


def test_only_a_hopper_gpu_takes_the_path():
    assert block_scaled_gemm.available(torch.device("cpu")) is False


HOPPER = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
    reason="needs a compute capability 9.x GPU (H100/H200)",
)


def _exact(a: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 product of the dequantised operands: what both GEMMs compute up to order and the bf16 cast."""
    return (a[0].float() * a[1].repeat_interleave(GROUP, dim=1)) @ dequantize_weight_block128(w, w_scale).t()


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(1280, 5120), (32768, 1280), (5120, 8192)])  # v41-s1's wq_a, wq_b, wo_b
@pytest.mark.parametrize("m", [1024, 1030])  # 1,030: padded to 1,032 rows for cuBLASLt (ROW_ALIGN)
def test_gpu_block_scaled_gemm_agrees_with_the_exact_product_as_the_triton_gemm_does(m, n, k, out_dtype):
    from kernels.fp8_weights import quantize_weight_block128
    from kernels.moe_grouped_gemm import moe_grouped_gemm
    from kernels.quant_fp8 import quantize_act
    from services.worker.kernel_model.fp8_linear import one_expert_meta

    dev = torch.device("cuda")
    assert block_scaled_gemm.available(dev)
    gen = torch.Generator(device=dev).manual_seed(n + k)
    w, w_scale = quantize_weight_block128(torch.randn(n, k, device=dev, generator=gen) * 0.02)
    a = quantize_act(torch.randn(m, k, device=dev, generator=gen).to(torch.bfloat16))
    exact = _exact(a, w, w_scale)
    cublas = block_scaled_gemm.matmul(a, w, block_scaled_gemm.scale_b(w_scale), out_dtype)
    triton = moe_grouped_gemm(
        a, w[None], w_scale[None], one_expert_meta(m, 1, dev), gather=True, block_m=32, num_warps=4, out_dtype=out_dtype
    )[0]
    print(
        f"\n{out_dtype} M {m} N {n} K {k}: cuBLASLt {_rel(cublas, exact):.3g}, Triton {_rel(triton, exact):.3g} "
        f"(relative to the exact product), between them {_rel(cublas, triton.float()):.3g}"
    )
    assert cublas.dtype == out_dtype and cublas.shape == (m, n)
    assert _rel(cublas, exact) <= PROBE_REL and _rel(triton, exact) <= PROBE_REL


@pytest.mark.gpu
@HOPPER
def test_gpu_kernel_linear_takes_it_from_linear_min_tokens_rows_and_agrees_below(monkeypatch):
    from services.worker.kernel_model.fp8_linear import KernelLinear
    from services.worker.kernel_model.kernel_set import KernelSet

    dev = torch.device("cuda")
    # Probed here, so the probes' own products are not counted below.
    assert block_scaled_gemm.available(dev) and block_scaled_gemm.available(dev, torch.float32)
    calls = []
    real = block_scaled_gemm.matmul
    monkeypatch.setattr(block_scaled_gemm, "matmul", lambda *args: calls.append(1) or real(*args))
    gen = torch.Generator(device=dev).manual_seed(0)
    layer = KernelLinear(torch.randn(1536, 5120, device=dev, generator=gen) * 0.02, "fp8", KernelSet.compiled())
    x = torch.randn(block_scaled_gemm.LINEAR_MIN_TOKENS, 5120, device=dev, generator=gen).to(torch.bfloat16)
    big = layer(x)  # LINEAR_MIN_TOKENS rows (decode's graph-captured sizes included): cuBLASLt
    assert len(calls) == 1
    small = layer(x[:-1])  # one row fewer: the Triton GEMM
    assert len(calls) == 1
    assert _rel(big[:-1], small.float()) <= 2 * PROBE_REL  # two bf16 roundings of nearly the same fp32 value
    wide = layer(x.float())  # fp32 activations: cuBLASLt with fp32 output
    assert wide.dtype == torch.float32 and len(calls) == 2
    assert _rel(big, wide) <= PROBE_REL  # the bf16 output is the fp32 one rounded, up to summation order


@pytest.mark.gpu
@HOPPER
@pytest.mark.parametrize("num_tokens", [block_scaled_gemm.GROUPED_MIN_TOKENS, block_scaled_gemm.GROUPED_MIN_TOKENS + 6])
def test_gpu_grouped_wo_a_takes_it_one_gemm_a_group_and_agrees_with_the_grouped_gemm(monkeypatch, num_tokens):
    """v41's wo_a (8 groups of 4,096 → 1,024): from ``GROUPED_MIN_TOKENS`` tokens one block-scaled GEMM a group, the
    result the Triton grouped GEMM's (``GROUPED_MIN_TOKENS`` raised) up to two bf16 roundings."""
    from services.worker.kernel_model.fp8_linear import GroupedKernelLinear
    from services.worker.kernel_model.kernel_set import KernelSet

    dev = torch.device("cuda")
    assert block_scaled_gemm.available(dev)
    calls = []
    real = block_scaled_gemm.matmul
    monkeypatch.setattr(block_scaled_gemm, "matmul", lambda *args: calls.append(1) or real(*args))
    gen = torch.Generator(device=dev).manual_seed(3)
    layer = GroupedKernelLinear(
        torch.randn(8 * 1024, 4096, device=dev, generator=gen) * 0.02, 8, "fp8", KernelSet.compiled()
    )
    x = torch.randn(num_tokens, 8, 4096, device=dev, generator=gen).to(torch.bfloat16)
    got = layer(x)
    assert len(calls) == 8 and got.shape == (num_tokens, 8 * 1024) and got.dtype == torch.bfloat16
    monkeypatch.setattr(block_scaled_gemm, "GROUPED_MIN_TOKENS", 1 << 30)
    want = layer(x)
    assert len(calls) == 8
    print(f"\nwo_a T {num_tokens}: cuBLASLt against the grouped GEMM {_rel(got, want.float()):.3g}")
    assert _rel(got, want.float()) <= 2 * PROBE_REL  # two bf16 roundings of nearly the same fp32 value
