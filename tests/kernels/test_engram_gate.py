"""Engram gate kernel vs Engram.forward's gate formula in float64: interpreted on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from tests.tolerances import BF16_CAST_REL, U_FP32

EPS = 1e-6


def _inputs(num_tokens: int, num_streams: int, dim: int, seed: int, dtype=torch.float32):
    """h [T, n, D]; key and value as the two views of one wkv output [T, (n+1)·D]; q/k weights 1 ± 0.2 (init.py)."""
    gen = torch.Generator().manual_seed(seed)
    h = (torch.randn(num_tokens, num_streams, dim, generator=gen) * 2).to(dtype)
    kv = torch.randn(num_tokens, (num_streams + 1) * dim, generator=gen).to(dtype)
    key, value = kv.split((num_streams * dim, dim), dim=-1)
    q_weight = 1 + 0.2 * torch.randn(num_streams, dim, generator=gen)
    k_weight = 1 + 0.2 * torch.randn(num_streams, dim, generator=gen)
    return h, key, value, q_weight, k_weight


def _reference(h, key, value, q_weight, k_weight, live):
    """Engram.forward's gate and residual add, transcribed in float64 (the exact value, up to 2^-53), and the
    float64 quantities the error bound needs: Σ|h·w·key|·rstd·D^-½, dot, gate."""
    num_tokens, num_streams, dim = h.shape
    hd = h.double()
    kd = key.double().view(num_tokens, num_streams, dim)
    w = q_weight.double() * k_weight.double()
    rstd = torch.rsqrt(hd.square().mean(-1) + EPS) * torch.rsqrt(kd.square().mean(-1) + EPS)
    dot = (hd * w * kd).sum(-1) * rstd * dim**-0.5
    mass = (hd * w * kd).abs().sum(-1) * rstd * dim**-0.5
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    if live is not None:
        gate = gate.masked_fill(~live.unsqueeze(-1), 0)
    out = hd + gate.unsqueeze(-1) * value.double().unsqueeze(-2)
    return out, mass, dot, gate


def _sum_depth(dim: int) -> int:
    """The most roundings a term of a D-term fp32 sum goes through, in every order the kernel sums in, for
    D ≤ 8192 (BLOCK_D ≤ 8192): the interpreter's ``tl.sum`` is numpy's pairwise sum (8 accumulators of ≤ 16
    sequential adds per 128-element block, 3 levels joining them, log2(D/128) ≤ 6 halving levels: ≤ 25);
    Triton's on the GPU adds BLOCK_D/(32·num_warps) ≤ 32 elements per thread sequentially, then 5 shuffle
    levels and ≤ 8 warps (≤ 45). Any order: ≤ D − 1."""
    assert dim <= 8192
    return min(dim - 1, 64)


def _bound(h, value, mass, dot, gate):
    """|out − exact| per element for fp32 arithmetic, first order in u = U_FP32, ×2 for the higher orders;
    m = ``_sum_depth(D)``:

    - a sum whose terms each pass through ≤ m roundings is off by ≤ m·u·Σ|terms|;
    - each term of the dot is h·w·key, three roundings (w's product, two multiplies): ≤ 3u·|term|;
      so the dot's sum is off by ≤ (m + 3)·u·Σ|h·w·key|, i.e. ≤ (m + 3)·u·mass after the exact scaling;
    - rstd: each mean of squares is ≤ (m + 2)·u relative (all terms ≥ 0, plus the squaring and the
      division), rsqrt halves it and adds its own error (≤ 4u: the GPU's rsqrt.approx is ≤ 2^-22.9
      relative), the product of the two adds u: ≤ (m + 11)·u relative; the two scalings add 2u: every
      dot is off by ≤ (m + 3)·u·mass + (m + 13)·u·|dot|;
    - sqrt(max(|dot|, 1e-6)) is 1/(2·max(√|dot|, 10^-3))-Lipschitz in dot, plus its own rounding (u);
    - sigmoid is ¼-Lipschitz; its exp and division (exp.approx on the GPU) add ≤ 8u to a gate ≤ 1;
    - out = h + gate·value: two roundings, ≤ 2u·(|h| + gate·|value|).
    A dead token's gate is exactly 0, so its output is h exactly."""
    dim = h.shape[-1]
    u = U_FP32
    m = _sum_depth(dim)
    d_dot = (m + 3) * u * mass + (m + 13) * u * dot.abs()
    root = dot.abs().clamp_min(1e-6).sqrt()
    d_root = d_dot / (2 * root) + u * root
    d_gate = torch.where(gate == 0, 0.0, d_root / 4 + 8 * u)
    hd, vd = h.double(), value.double().unsqueeze(-2)
    return 2 * (d_gate.unsqueeze(-1) * vd.abs() + 2 * u * (hd.abs() + gate.unsqueeze(-1) * vd.abs()))


def _check(out, h, key, value, q_weight, k_weight, live):
    ref, mass, dot, gate = _reference(h, key, value, q_weight, k_weight, live)
    tol = _bound(h, value, mass, dot, gate)
    if h.dtype == torch.bfloat16:  # one cast of the fp32 result; the interpreter truncates (2·u_bf16)
        tol = tol + BF16_CAST_REL * ref.abs()
    assert out.dtype == h.dtype and out.shape == h.shape
    err = (out.double() - ref).abs()
    assert torch.all(err <= tol), f"max excess {(err - tol).max().item()}"
    if live is not None:  # a dead token passes h through unchanged
        assert torch.equal(out[~live], h[~live])


@pytest.mark.parametrize(
    ("num_tokens", "dim", "dtype"), [(6, 64, torch.float32), (3, 5120, torch.float32), (5, 96, torch.bfloat16)]
)
@pytest.mark.parametrize("masked", [False, True])
def test_engram_gate_interpreted_matches_reference(num_tokens, dim, dtype, masked):
    """n = 4 streams; D 64 (the tiny preset's hidden size), 5120 (v41's), 96 (not a power of two: masked lanes)."""
    h, key, value, qw, kw = _inputs(num_tokens, 4, dim, num_tokens * dim, dtype)
    live = None
    if masked:
        live = torch.ones(num_tokens, dtype=torch.bool)
        live[1::2] = False
    with interpreter():
        out = load_interpreted("engram_gate").engram_gate(h, key, value, qw, kw, EPS, live)
    _check(out, h, key, value, qw, kw, live)


def test_engram_gate_interpreted_small_dot_and_negative_zero():
    """Rows whose dot lands in the clamp (|dot| < 10^-6) and on ±0.0: the gate is sigmoid(±10^-3)."""
    h, key, value, qw, kw = _inputs(3, 4, 64, 5)
    key = key.clone()
    key[0] = 0.0  # dot +0.0 (a zero key: rstd finite through eps)
    key[1] = 0.0
    h = h.clone()
    h[1] = -h[1]  # −h · 0 = −0.0 terms: the sum is still +0.0 under round-to-nearest, as torch's is
    with interpreter():
        out = load_interpreted("engram_gate").engram_gate(h, key, value, qw, kw, EPS)
    _check(out, h, key, value, qw, kw, None)


def test_engram_gate_interpreted_row_invariant():
    """A token's output bits are the same alone and at any place in a batch (one program per row)."""
    h, key, value, qw, kw = _inputs(7, 4, 64, 11)
    live = torch.tensor([True, False, True, True, False, True, True])
    with interpreter():
        module = load_interpreted("engram_gate")
        batch = module.engram_gate(h, key, value, qw, kw, EPS, live)
        for t in range(7):
            one = module.engram_gate(h[t : t + 1], key[t : t + 1], value[t : t + 1], qw, kw, EPS, live[t : t + 1])
            assert torch.equal(one[0], batch[t])
        tail = module.engram_gate(h[3:], key[3:], value[3:], qw, kw, EPS, live[3:])
    assert torch.equal(tail, batch[3:])


def test_engram_gate_rejects_bad_shapes():
    h, key, value, qw, kw = _inputs(2, 4, 64, 3)
    with interpreter():
        module = load_interpreted("engram_gate")
        with pytest.raises(ValueError):
            module.engram_gate(h, key[:, :-1], value, qw, kw, EPS)
        with pytest.raises(ValueError):
            module.engram_gate(h, key, value, qw, kw, EPS, torch.ones(2, dtype=torch.int64))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 8, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_engram_gate_gpu_matches_reference_and_is_row_invariant(num_tokens, dtype):
    """Compiled, at v41's n = 4 and D = 5120, against the float64 formula with the same fp32 bound (it
    covers the GPU's rsqrt/exp approximations); the bf16 cast rounds to nearest (≤ u_bf16 ≤ BF16_CAST_REL)."""
    from kernels.engram_gate import engram_gate

    h, key, value, qw, kw = (t.cuda() for t in _inputs(num_tokens, 4, 5120, num_tokens, dtype))
    live = torch.arange(num_tokens, device="cuda") % 3 != 1
    out = engram_gate(h, key, value, qw, kw, EPS, live)
    _check(out.cpu(), h.cpu(), key.cpu(), value.cpu(), qw.cpu(), kw.cpu(), live.cpu())
    one = engram_gate(h[-1:], key[-1:], value[-1:], qw, kw, EPS, live[-1:])
    assert torch.equal(one[0], out[-1])
