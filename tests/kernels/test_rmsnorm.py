"""RMSNorm kernel vs ``kernels.reference.rmsnorm``: interpreted on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.interpret import interpreter, load_interpreted
from tests.tolerances import BF16_CAST_REL, FP32_REORDER_REL


@pytest.mark.parametrize(
    ("rows", "channels", "dtype"), [(5, 300, torch.bfloat16), (33, 64, torch.float32), (2, 5120, torch.bfloat16)]
)
def test_rmsnorm_interpreted_matches_reference(rows, channels, dtype):
    gen = torch.Generator().manual_seed(rows * channels)
    x = (torch.randn(rows, channels, generator=gen) * 3).to(dtype)
    w = torch.randn(channels, generator=gen)
    with interpreter():
        y = load_interpreted("rmsnorm").rmsnorm(x, w, 1e-20)
    ref = reference.rmsnorm(x, w, 1e-20)
    assert y.dtype == dtype and y.shape == x.shape
    # The interpreter casts fp32 → bf16 by truncation: allow one bf16 ulp (2^-7 relative).
    tol = BF16_CAST_REL if dtype == torch.bfloat16 else FP32_REORDER_REL
    assert torch.all((y.float() - ref.float()).abs() <= tol * ref.float().abs() + 1e-6)


def test_rmsnorm_interpreted_strided_rows_and_zero_row():
    gen = torch.Generator().manual_seed(1)
    base = torch.randn(6, 256, generator=gen)
    base[3] = 0.0  # eps keeps an all-zero row finite: it normalises to 0
    x = base[:, :200]  # rows 256 apart, 200 channels used
    w = torch.randn(200, generator=gen)
    with interpreter():
        y = load_interpreted("rmsnorm").rmsnorm(x, w, 1e-20)
    torch.testing.assert_close(y, reference.rmsnorm(x, w, 1e-20), rtol=FP32_REORDER_REL, atol=1e-6)
    assert torch.all(y[3] == 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 256, 4096])
def test_rmsnorm_gpu_matches_reference(rows):
    from kernels.rmsnorm import rmsnorm

    x = torch.randn(rows, 5120, device="cuda", dtype=torch.bfloat16) * 4
    w = torch.randn(5120, device="cuda")
    y = torch.full_like(x, float("nan"))
    rmsnorm(x, w, 1e-20, out=y)
    ref = reference.rmsnorm(x, w, 1e-20)
    # Same fp32 maths, different summation order: at most one bf16 rounding step apart.
    assert torch.all((y.float() - ref.float()).abs() <= BF16_CAST_REL * ref.float().abs() + 1e-6)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The bytes of t as integers: equality of these is bit-equality (−0 ≠ +0, NaN == NaN)."""
    return t.contiguous().view(torch.uint8)


def _unfused(rmsnorm_module, quant_module, x, w, eps):
    """The unfused path: the norm, then ``quantize_act`` of its output zero-padded to a multiple of 128."""
    y = rmsnorm_module.rmsnorm(x, w, eps)
    padded = -(-x.shape[-1] // 128) * 128
    return y, quant_module.quantize_act(torch.nn.functional.pad(y, (0, padded - x.shape[-1])).contiguous())


@pytest.mark.parametrize(
    ("rows", "channels", "dtype"),
    [(5, 300, torch.bfloat16), (3, 64, torch.float32), (2, 7168, torch.bfloat16), (17, 1536, torch.float32),
     (4, 32, torch.bfloat16), (1, 512, torch.bfloat16)],
)
def test_rmsnorm_quant_interpreted_equals_norm_then_quantize_bit_for_bit(rows, channels, dtype):
    gen = torch.Generator().manual_seed(rows + channels)
    # Row scales across 2^±20 exercise the power-of-two scale; a zero row, the eps floor; tiny values, e4m3's
    # subnormals and −0.
    x = (torch.randn(rows, channels, generator=gen) * torch.logspace(-20, 20, rows, base=2.0)[:, None]).to(dtype)
    x[0, : channels // 2] = 0.0
    if rows > 2:
        x[2] = 0.0
    w = torch.randn(channels, generator=gen) * 4
    w[: channels // 8] *= 1e-6  # normed values far below the group's largest: e4m3 subnormals and −0
    with interpreter():
        norm, quant = load_interpreted("rmsnorm"), load_interpreted("quant_fp8")
        y, (q, s) = norm.rmsnorm_quant(x, w, 1e-6)
        y0, (q0, s0) = _unfused(norm, quant, x, w, 1e-6)
    assert y.dtype == dtype and q.shape == q0.shape and s.shape == s0.shape
    assert torch.equal(_bits(y), _bits(y0))
    assert torch.equal(_bits(q), _bits(q0)) and torch.equal(_bits(s), _bits(s0))


def test_rmsnorm_quant_interpreted_reads_strided_rows_and_checks_shapes():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 384, generator=gen)[:, :256]  # rows 384 apart
    w = torch.randn(256, generator=gen)
    with interpreter():
        norm, quant = load_interpreted("rmsnorm"), load_interpreted("quant_fp8")
        y, (q, s) = norm.rmsnorm_quant(x, w, 1e-6)
        y0, (q0, s0) = _unfused(norm, quant, x.contiguous(), w, 1e-6)
        empty_y, (empty_q, empty_s) = norm.rmsnorm_quant(x[:0], w, 1e-6)
        with pytest.raises(ValueError, match="weight shape"):
            norm.rmsnorm_quant(x, w[:100], 1e-6)
    assert torch.equal(_bits(y), _bits(y0)) and torch.equal(_bits(q), _bits(q0)) and torch.equal(s, s0)
    assert empty_y.shape == (0, 256) and empty_q.shape == (0, 256) and empty_s.shape == (0, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("rows", "channels"), [(1, 7168), (64, 7168), (256, 1536), (5, 300), (3, 64)])
def test_rmsnorm_quant_gpu_equals_norm_then_quantize_bit_for_bit(rows, channels):
    from kernels import quant_fp8, rmsnorm

    x = torch.randn(rows, channels, device="cuda", dtype=torch.bfloat16) * 4
    w = torch.randn(channels, device="cuda")
    y, (q, s) = rmsnorm.rmsnorm_quant(x, w, 1e-6)
    y0, (q0, s0) = _unfused(rmsnorm, quant_fp8, x, w, 1e-6)
    assert torch.equal(_bits(y), _bits(y0))
    assert torch.equal(_bits(q), _bits(q0)) and torch.equal(_bits(s), _bits(s0))
