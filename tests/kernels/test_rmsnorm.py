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
