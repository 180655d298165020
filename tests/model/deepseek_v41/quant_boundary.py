"""How far inputs sit from a rounding discontinuity of the cache formats (``quant.py``), to trace
quantisation "bin flips" in oracle comparisons: a value within ~1e-5 of a boundary can change bins
under fp32 reordering noise, so a mismatch there is not a fault."""

from __future__ import annotations

import torch

from model.deepseek_v41.quant import (
    _E2M1_MIDPOINTS,
    _MIN_NORMAL,
    FP4_E2M1_MAX,
    FP8_CACHE_BLOCK,
    FP8_E4M3_MAX,
    ScaleFormat,
    _blocks,
    _fp4_scale,
    _fp8_cache_scale,
    _unblock,
)

__all__ = ["fp4_boundary_distance", "fp8_boundary_distance"]


def _e4m3_midpoints(r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For non-negative e4m3-representable r: the rounding boundaries below and above it.

    Below 0 there is none (±0 are the same value): -inf. Above 448 there is none (clamped): +inf.
    """
    code = r.to(torch.float8_e4m3fn).view(torch.uint8).to(torch.int32)
    up = (code + 1).clamp_max(0x7E).to(torch.uint8).view(torch.float8_e4m3fn).float()
    down = (code - 1).clamp_min(0).to(torch.uint8).view(torch.float8_e4m3fn).float()
    inf = torch.full_like(r, float("inf"))
    return torch.where(code > 0, (r + down) / 2, -inf), torch.where(code < 0x7E, (r + up) / 2, inf)


def _scale_distance(
    amax: torch.Tensor, scale: torch.Tensor, below: torch.Tensor, above: torch.Tensor, floor: float
) -> torch.Tensor:
    """|amax| to the nearest amax at which the block scale would change (in input units)."""
    lower = torch.where(below >= floor, amax - below, torch.full_like(amax, float("inf")))
    return torch.minimum(above - amax, lower)


def fp8_boundary_distance(x: torch.Tensor, block: int = FP8_CACHE_BLOCK) -> torch.Tensor:
    """Per element of ``x`` [..., C]: fp32 distance (input units) to the nearest discontinuity of
    ``fake_quant_fp8_e4m3(x, block)``: min of the element's own e4m3 rounding boundary and the
    boundary of its block's power-of-two scale (all elements of a block share the latter).
    A value within ~1e-5 of a boundary can flip bins under fp32 reordering noise.
    """
    grouped = _blocks(x, block)
    amax = grouped.abs().amax(-1, keepdim=True)
    scale = _fp8_cache_scale(amax)
    a = (grouped / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).abs()
    low, high = _e4m3_midpoints(a.to(torch.float8_e4m3fn).float())
    own = torch.minimum(a - low, high - a) * scale
    block_d = _scale_distance(amax, scale, scale * (FP8_E4M3_MAX / 2), scale * FP8_E4M3_MAX, 1e-4)
    return _unblock(torch.minimum(own, block_d), x.shape[-1])


def fp4_boundary_distance(x: torch.Tensor, block: int, scale_format: ScaleFormat) -> torch.Tensor:
    """Like ``fp8_boundary_distance`` for ``fake_quant_fp4_e2m1(x, block, scale_format)``.

    Element boundaries are the e2m1 midpoints (0.25 … 5.0) times the scale; block boundaries are
    where the power-of-two (e8m0) or e4m3-rounded (e4m3) scale steps.
    """
    grouped = _blocks(x, block)
    amax = grouped.abs().amax(-1, keepdim=True)
    scale = _fp4_scale(amax, scale_format)
    a = (grouped / scale).clamp(-FP4_E2M1_MAX, FP4_E2M1_MAX).abs()
    own = (a.unsqueeze(-1) - a.new_tensor(_E2M1_MIDPOINTS)).abs().amin(-1) * scale
    if scale_format == "e8m0":
        floor = FP4_E2M1_MAX * _MIN_NORMAL
        block_d = _scale_distance(amax, scale, scale * (FP4_E2M1_MAX / 2), scale * FP4_E2M1_MAX, floor)
    else:
        floor = FP4_E2M1_MAX * 2.0**-9
        low, high = _e4m3_midpoints(scale)
        block_d = _scale_distance(amax, scale, low * FP4_E2M1_MAX, high * FP4_E2M1_MAX, floor)
    return _unblock(torch.minimum(own, block_d), x.shape[-1])
