"""RMSNorm kernel vs ``kernels.reference.rmsnorm``: interpreted on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted
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


def _rope_inputs(rows: int, heads: int, dim: int, pairs: int, seed: int):
    from model.deepseek_v41.rope import rope_turns

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, dim, generator=gen) * 3
    w = torch.randn(dim, generator=gen)
    q = torch.randn(rows, heads, dim, generator=gen)
    angles = torch.randint(0, 5000, (rows,), generator=gen).float()[:, None] * torch.rand(pairs, generator=gen)
    return x, w, q, rope_turns(angles)


@pytest.mark.parametrize(("rows", "heads", "dim", "pairs"), [(5, 3, 96, 16), (8, 16, 128, 32), (1, 5, 64, 8)])
def test_rmsnorm_rope_interpreted_equals_norm_then_apply_rope_(rows, heads, dim, pairs):
    """One launch, the same bits as the three it replaces: ``kv_norm`` then ``apply_rope_`` on it and on q."""
    from model.deepseek_v41.rope import apply_rope_

    x, w, q, turns = _rope_inputs(rows, heads, dim, pairs, rows * heads + dim)
    with interpreter():
        module = load_interpreted("rmsnorm")
        want_k = apply_rope_(module.rmsnorm(x, w, 1e-6), turns)
        q_fused = q.clone()
        k = module.rmsnorm_rope(x, w, 1e-6, turns, q_fused)
    want_q = apply_rope_(q.clone(), turns)
    assert torch.equal(k, want_k)
    assert torch.equal(q_fused, want_q)
    # The unrotated channels are the plain norm's, and q's are untouched.
    assert torch.equal(q_fused[..., : dim - 2 * pairs], q[..., : dim - 2 * pairs])


def test_rmsnorm_rope_interpreted_strided_rows_and_head_blocks(monkeypatch):
    """x rows at a stride, q a view with padded heads, and more heads than one program takes."""
    from model.deepseek_v41.rope import apply_rope_

    x, w, q, turns = _rope_inputs(3, 40, 64, 32, 7)
    x_wide = torch.zeros(3, 80)
    x_wide[:, :64] = x
    q_wide = torch.zeros(3, 40, 96)
    q_wide[..., :64] = q
    q_view = q_wide[..., :64]
    with interpreter():
        module = load_interpreted("rmsnorm")
        monkeypatch.setattr(module, "ROPE_PAIRS_PER_PROGRAM", 256)  # several head blocks
        want_k = apply_rope_(module.rmsnorm(x, w, 1e-6), turns)
        k = module.rmsnorm_rope(x_wide[:, :64], w, 1e-6, turns, q_view)
    assert torch.equal(k, want_k)
    assert torch.equal(q_view, apply_rope_(q.clone(), turns))
    assert torch.all(q_wide[..., 64:] == 0)


def test_rmsnorm_rope_rejects_other_dtypes():
    x, w, q, turns = _rope_inputs(2, 2, 64, 8, 3)
    with interpreter():
        module = load_interpreted("rmsnorm")
        with pytest.raises(ValueError):
            module.rmsnorm_rope(x.bfloat16(), w, 1e-6, turns, q)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rmsnorm_rope_gpu_matches_norm_then_apply_rope_():
    """Compiled: the fused launch against the three it replaces, at v41's attention shapes (R 8, H 64, hd 512,
    P 32). The rotation may contract to FMAs differently from torch's complex multiply: one fp32 rounding."""
    from kernels.rmsnorm import rmsnorm, rmsnorm_rope
    from model.deepseek_v41.rope import apply_rope_

    x, w, q, turns = (t.cuda() for t in _rope_inputs(8, 64, 512, 32, 11))
    want_k = apply_rope_(rmsnorm(x, w, 1e-6), turns)
    want_q = apply_rope_(q.clone(), turns)
    k = rmsnorm_rope(x, w, 1e-6, turns, q)
    torch.testing.assert_close(k, want_k, rtol=FP32_REORDER_REL, atol=1e-6)
    torch.testing.assert_close(q, want_q, rtol=FP32_REORDER_REL, atol=1e-6)
