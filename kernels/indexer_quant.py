"""The indexer query's FP4 fake quantisation (spec §3.7) in one launch.

``model.deepseek_v41.quant.fake_quant_indexer`` (e2m1 codes, one power-of-two scale per 32
channels) takes about 28 torch launches (pad, abs, amax, clamp, scale bits, divide, clamp, bucketize,
tie fix, sign, table decode, multiply, cast). Per block b of 32 channels:

    scale_b = pow2_ceil(max(amax_b, 6·2^-126) · (1/6))
    y       = e2m1(x / scale_b) · scale_b       in x's dtype

e2m1 rounds |x/scale| (clamped to 6) to the nearest of {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even
code, and a negative input keeps its sign (a negative that rounds to zero gives −0.0). Every step is
exact (a max, power-of-two scales, comparisons), and y has at most 2 significant bits, so it casts to
bf16 exactly: the result is ``==`` the torch form (tests/kernels/test_indexer_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_fp8 import _pow2_ceil

BLOCK = 32  # channels per scale (model.deepseek_v41.quant.INDEXER_BLOCK)
MIN_AMAX = 6.0 * 2.0**-126  # the smallest normal scale times 6: exact in fp32


@triton.jit
def _e2m1_magnitude(m):
    """|x/scale| (fp32 ≥ 0) → the e2m1 magnitude the torch encoder picks: level i is the count of
    midpoints below m, plus one at the ties 0.75, 1.75, 3.5 whose lower level has an odd code."""
    level = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
             + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    # Levels 0..4 are 0, .5, 1, 1.5, 2 (level / 2); 5, 6, 7 are 3, 4, 6.
    return tl.where(level <= 4, level.to(tl.float32) * 0.5,
                    tl.where(level == 5, 3.0, tl.where(level == 6, 4.0, 6.0)))


@triton.jit
def _fake_quant_kernel(x_ptr, y_ptr, num_blocks, ROWS: tl.constexpr, BLOCK: tl.constexpr, MIN_AMAX: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # a row is one block of 32 contiguous channels
    offsets = rows[:, None].to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]
    ok = (rows < num_blocks)[:, None]
    x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = _pow2_ceil(tl.maximum(amax, MIN_AMAX) * (1.0 / 6.0))
    biased = (scale.to(tl.int32, bitcast=True) >> 23) & 255  # in [1, 254]: scale ≥ 2^-126, amax is finite
    inv_scale = ((254 - biased) << 23).to(tl.float32, bitcast=True)  # exact: 2^-e, a normal number
    v = x * inv_scale[:, None]  # == torch's x / scale (one rounding of the same real value)
    y = _e2m1_magnitude(tl.abs(v)) * scale[:, None]  # exact: ≤ 2 significant bits times a power of two
    # The sign by its bit (Triton's −y is 0 − y, which loses −0.0): set iff x/scale < 0, as torch's code 8.
    sign = tl.where(v < 0, -2147483648, 0).to(tl.int32)
    y = (y.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    tl.store(y_ptr + offsets, y.to(y_ptr.dtype.element_ty), mask=ok)


def fake_quant_indexer(x: torch.Tensor) -> torch.Tensor:
    """x [..., C] (C % 32 == 0, fp32/bf16) → FP4-rounded x, same shape and dtype."""
    channels = x.shape[-1]
    if channels % BLOCK:
        raise ValueError(f"fake_quant_indexer needs channels a multiple of {BLOCK}, got {channels}")
    if not x.is_contiguous():
        x = x.contiguous()
    y = torch.empty_like(x)
    num_blocks = x.numel() // BLOCK
    if num_blocks == 0:
        return y
    rows = 32
    _fake_quant_kernel[(triton.cdiv(num_blocks, rows),)](x, y, num_blocks, ROWS=rows, BLOCK=BLOCK, MIN_AMAX=MIN_AMAX)
    return y
