"""Activation quantisation to FP8: per token and per 128 channels, e4m3 with a power-of-two scale.

``quantize_act`` is the stand-alone op (x [T, C] → e4m3 [T, C], fp32 scales [T, C/128]);
``swiglu_quant`` applies the experts' clamped SwiGLU and route weight to a bf16 gate/up product first (the
Triton grouped GEMM's epilogue, for GEMMs without one), in the same launch. The jit
helpers here are shared with the kernels that quantise inside their own loops or epilogues, so
every path rounds the same way. Reference: ``kernels.reference.quantize_act``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.reference import GROUP

Activations = torch.Tensor | tuple[torch.Tensor, torch.Tensor]
"""A GEMM's input: bf16/fp32 values (quantised inside the GEMM), or ``quantize_act``'s (e4m3 values, fp32
scales per 128 channels)."""

IN_GEMM_MAX_ROWS = int(os.environ.get("SHINKAI_IN_GEMM_MAX_ROWS", "16"))
"""Up to this many rows (decode's one 16-row MMA tile) the FP8 GEMMs take bf16/fp32 activations and quantise
them in their K loops with ``_quantize_rows`` (``quantize_act``'s rounding: the same e4m3 values and scales,
so the same product bits), which saves ``quantize_act``'s launch. Each N tile quantises the rows again: at one
M tile, one [16, 128] block per K step beside the [128, 128] weight block it multiplies. Above it the rows
are quantised once by ``quantize_act`` for every N tile (and cuBLASLt's block-scaled GEMM takes only that).
The cost is registers (ptxas sm_90a, 4 warps: split-K wq_a 139 → 239, wo_b 116 → 255 with 20 bytes spilled;
the one-expert wq_b GEMM 168 → 254); ``SHINKAI_IN_GEMM_MAX_ROWS=0`` (read at import) turns it off, to time
both on the device."""


@triton.jit
def _pow2_ceil(value):
    """Smallest power of two ≥ value (positive normal fp32), exactly, from the bits."""
    bits = value.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 255
    has_mantissa = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((exponent + has_mantissa) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3_grid(v):
    """Round fp32 |v| ≤ 448 to the nearest e4m3 value, ties to even, staying in fp32.

    The cast to e4m3 that follows is then exact on every backend (Triton's interpreter rounds
    fp32 → fp8 half-up without carrying into the exponent, so it must never have to round).
    """
    bits = v.to(tl.int32, bitcast=True)
    # Normal range (|v| ≥ 2^-6): keep 3 mantissa bits, ties to even, carries into the exponent.
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal range: multiples of 2^-9; adding 1.5·2^14 to |v| leaves exactly that grid (ties to
    # even). The sign bit is copied back (Triton's −x is 0 − x, which turns −0 into +0), so tiny
    # negatives give −0 as a cast would.
    sub_magnitude = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.int32, bitcast=True)
    sub = (sub_magnitude | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quantize_rows(a):
    """fp32 [M, 128] → (e4m3 [M, 128], fp32 power-of-two scale [M]); |a / scale| ≤ 448 by construction."""
    amax = tl.max(tl.abs(a), axis=1)
    scale = _pow2_ceil(tl.maximum(amax * (1.0 / 448.0), 1.1754943508222875e-38))
    # 1/scale is exact: negate the exponent (scale = 2^(b-127) with b in [1, 254]).
    inv_bits = (254 - ((scale.to(tl.int32, bitcast=True) >> 23) & 255)) << 23
    inv_scale = inv_bits.to(tl.float32, bitcast=True)
    return _round_to_e4m3_grid(a * inv_scale[:, None]).to(tl.float8e4nv), scale


@triton.jit(do_not_specialize=("num_rows",))
def _quantize_act_kernel(
    x_ptr, q_ptr, s_ptr, num_rows, x_row_stride, GROUPS: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * BLOCK + tl.arange(0, BLOCK)
    ok = rows < num_rows
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row_stride + cols[None, :], mask=ok[:, None], other=0.0)
    q, scale = _quantize_rows(x.to(tl.float32))
    tl.store(q_ptr + rows[:, None].to(tl.int64) * (GROUPS * BLOCK) + cols[None, :], q, mask=ok[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * GROUPS + group, scale, mask=ok)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C] (C % 128 == 0, bf16/fp32) → (e4m3 [T, C], fp32 [T, C/128]); x ≈ q · scale."""
    num_rows, channels = x.shape
    if channels % GROUP:
        raise ValueError(f"channels must be a multiple of {GROUP}, got {channels}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    q, s, grid = _outputs(num_rows, channels, x.device)
    _quantize_act_kernel[grid](x, q, s, num_rows, x.stride(0), GROUPS=channels // GROUP, ROWS=ROWS, BLOCK=GROUP)
    return q, s


ROWS = 16
"""Rows per program of the stand-alone quantisers (one 128-channel group each)."""


def _outputs(num_rows: int, channels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """e4m3 [rows, C] and fp32 [rows, C/128] outputs, and the launch grid over row blocks and groups."""
    q = torch.empty(num_rows, channels, dtype=torch.float8_e4m3fn, device=device)
    s = torch.empty(num_rows, channels // GROUP, dtype=torch.float32, device=device)
    return q, s, (triton.cdiv(num_rows, ROWS), channels // GROUP)


@triton.jit(do_not_specialize=("num_rows",))
def _swiglu_quant_kernel(
    gu_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    num_rows,
    gu_row_stride,
    swiglu_limit,
    GROUPS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * BLOCK + tl.arange(0, BLOCK)
    ok = rows < num_rows
    base = gu_ptr + rows[:, None].to(tl.int64) * gu_row_stride + cols[None, :]
    gate = tl.minimum(tl.load(base, mask=ok[:, None], other=0.0).to(tl.float32), swiglu_limit)
    up = tl.load(base + GROUPS * BLOCK, mask=ok[:, None], other=0.0).to(tl.float32)
    up = tl.minimum(tl.maximum(up, -swiglu_limit), swiglu_limit)
    route_w = tl.load(w_ptr + rows, mask=ok, other=0.0)
    h = gate / (1.0 + tl.exp(-gate)) * up * route_w[:, None]  # the grouped GEMM's SwiGLU epilogue, term for term
    q, scale = _quantize_rows(h)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * (GROUPS * BLOCK) + cols[None, :], q, mask=ok[:, None])
    tl.store(s_ptr + rows.to(tl.int64) * GROUPS + group, scale, mask=ok)


def swiglu_quant(
    gate_up: torch.Tensor, route_w: torch.Tensor, swiglu_limit: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (gate columns, then up; bf16/fp32, unit column stride), route_w fp32 [M] →
    ``quantize_act``(silu(min(gate, L)) · clamp(up, −L, L) · route_w): (e4m3 [M, I], fp32 [M, I/128])."""
    num_rows, width = gate_up.shape
    inter = width // 2
    if width % 2 or inter % GROUP:
        raise ValueError(f"gate_up's width must be 2·I with I a multiple of {GROUP}, got {width}")
    if route_w.shape != (num_rows,):
        raise ValueError(f"route_w must be [{num_rows}], got {list(route_w.shape)}")
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    q, s, grid = _outputs(num_rows, inter, gate_up.device)
    _swiglu_quant_kernel[grid](
        gate_up,
        route_w.float().contiguous(),
        q,
        s,
        num_rows,
        gate_up.stride(0),
        float(swiglu_limit),
        GROUPS=inter // GROUP,
        ROWS=ROWS,
        BLOCK=GROUP,
    )
    return q, s
