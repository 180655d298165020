"""Load-time conversion of expert weights to the grouped GEMM's format (pure torch).

The kernels read e4m3 weights with one fp32 power-of-two scale per 128×128 block. Why 128 and not
the checkpoint's 32 (32×32 e8m0 for dense FP8, 1×32 e8m0 for MXFP4 experts): with K blocks of 128
the kernel applies one scale per 128-deep MMA step (a scalar per weight tile, and the same 1×128
activation groups), instead of splitting every K step into four 32-deep MMAs with a rescale each.

MXFP4 → e4m3 is exact whenever, within a 128×128 block, the 1×32 row scales span at most 14
binades: e2m1 values (0.5 … 6, one mantissa bit) times 2^(s − s_max) stay on the e4m3 grid down to
its smallest subnormal 2^-9 (block scale 2^(s_max−6), so the largest code is 6·2^6 = 384 ≤ 448).
``convert_*`` report how many elements were not exact (rounded to nearest even instead).
"""

from __future__ import annotations

import torch

from kernels.reference import GROUP, dequantize_weight_block128
from model.deepseek_v41.quant import FP8_E4M3_MAX, dequantize_fp8_block, dequantize_mxfp4, pow2_ceil


def quantize_weight_block128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., N, K] (N, K multiples of 128) → (e4m3 [..., N, K], fp32 [..., N/128, K/128])."""
    n, k = w.shape[-2:]
    if n % GROUP or k % GROUP:
        raise ValueError(f"weight shape {tuple(w.shape)}: both dims must be multiples of {GROUP}")
    tiles = w.float().unflatten(-1, (-1, GROUP)).unflatten(-3, (-1, GROUP))  # [..., nb, 128, kb, 128]
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., nb, kb]
    # True division, so amax = 448·2^j keeps scale 2^j (as model/deepseek_v41/quant.py).
    scale = pow2_ceil(amax.clamp_min(FP8_E4M3_MAX * 2.0**-126) / amax.new_full((), FP8_E4M3_MAX))
    q = (tiles / scale[..., :, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q.flatten(-2).flatten(-3, -2), scale


def _convert(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    q, scale = quantize_weight_block128(values)
    inexact = int((dequantize_weight_block128(q, scale) != values).sum())
    return q, scale, inexact


def convert_mxfp4_expert(packed: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One expert matrix as stored (int8 [R, C/2], e8m0 [R, C/32]) → (e4m3, fp32 block scales, #inexact)."""
    return _convert(dequantize_mxfp4(packed, scale))


def convert_fp8_block32(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A dense FP8 matrix with 32×32 e8m0 scales → (e4m3, 128×128 fp32 scales, #inexact)."""
    return _convert(dequantize_fp8_block(q, scale))


def stack_gate_up(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """[E, I, D] gate and up → [E, 2I, D]: rows [0, I) gate, [I, 2I) up (the fused kernel's layout)."""
    return torch.cat((w1, w3), dim=-2)
