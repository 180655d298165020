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

With ``turns`` the kernel applies the query's RoPE first (``kernels.rmsnorm._rotate``: the bits of
``apply_rope_``'s complex multiply), one launch where there were two.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_fp8 import _pow2_ceil
from kernels.rmsnorm import _rotate

BLOCK = 32  # channels per scale (model.deepseek_v41.quant.INDEXER_BLOCK)
MIN_AMAX = 6.0 * 2.0**-126  # the smallest normal scale times 6: exact in fp32


@triton.jit
def _e2m1_magnitude(m):
    """|x/scale| (fp32 ≥ 0) → the e2m1 magnitude the torch encoder picks: level i is the count of
    midpoints below m, plus one at the ties 0.75, 1.75, 3.5 whose lower level has an odd code."""
    level = (
        (m > 0.25).to(tl.int32)
        + (m >= 0.75).to(tl.int32)
        + (m > 1.25).to(tl.int32)
        + (m >= 1.75).to(tl.int32)
        + (m > 2.5).to(tl.int32)
        + (m >= 3.5).to(tl.int32)
        + (m > 5.0).to(tl.int32)
    )
    # Levels 0..4 are 0, .5, 1, 1.5, 2 (level / 2); 5, 6, 7 are 3, 4, 6.
    return tl.where(level <= 4, level.to(tl.float32) * 0.5, tl.where(level == 5, 3.0, tl.where(level == 6, 4.0, 6.0)))


@triton.jit
def _fp4(x, scale, inv_scale):
    """x fp32 [ROWS, n] → its e2m1 value times the block's scale [ROWS], fp32 (sign bit kept)."""
    v = x * inv_scale[:, None]  # == torch's x / scale (one rounding of the same real value)
    y = _e2m1_magnitude(tl.abs(v)) * scale[:, None]  # exact: ≤ 2 significant bits times a power of two
    # The sign by its bit (Triton's −y is 0 − y, which loses −0.0): set iff x/scale < 0, as torch's code 8.
    sign = tl.where(v < 0, -2147483648, 0).to(tl.int32)
    return (y.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scales(amax, MIN_AMAX: tl.constexpr):
    """A block's amax [ROWS] → (scale, 1/scale), both exact powers of two."""
    scale = _pow2_ceil(tl.maximum(amax, MIN_AMAX) * (1.0 / 6.0))
    biased = (scale.to(tl.int32, bitcast=True) >> 23) & 255  # in [1, 254]: scale ≥ 2^-126, amax is finite
    inv_scale = ((254 - biased) << 23).to(tl.float32, bitcast=True)  # exact: 2^-e, a normal number
    return scale, inv_scale


@triton.jit(do_not_specialize=("num_blocks",))
def _fake_quant_kernel(
    x_ptr,
    y_ptr,
    turn_ptr,
    num_blocks,
    blocks_per_row,
    blocks_per_head,
    rope_start,
    turn_row_stride,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    MIN_AMAX: tl.constexpr,
    ROPE: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # a row is one block of 32 contiguous channels
    ok = (rows < num_blocks)[:, None]
    if not ROPE:
        offsets = rows[:, None].to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[None, :]
        x = tl.load(x_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        scale, inv_scale = _scales(tl.max(tl.abs(x), axis=1), MIN_AMAX)
        tl.store(y_ptr + offsets, _fp4(x, scale, inv_scale).to(y_ptr.dtype.element_ty), mask=ok)
    else:
        # RoPE first, as (even, odd) halves: a head's channels from rope_start on are its rotated pairs
        # (rope_start even), pair j at channels rope_start + 2j, + 2j + 1.
        half = tl.arange(0, BLOCK // 2)
        even = rows[:, None].to(tl.int64) * BLOCK + 2 * half[None, :]
        a = tl.load(x_ptr + even, mask=ok, other=0.0).to(tl.float32)
        b = tl.load(x_ptr + even + 1, mask=ok, other=0.0).to(tl.float32)
        channel = (rows % blocks_per_head)[:, None] * BLOCK + 2 * half[None, :]  # the pair's even channel in its head
        rotated = channel >= rope_start
        pair = (channel - rope_start) // 2
        turn = turn_ptr + (rows // blocks_per_row)[:, None].to(tl.int64) * turn_row_stride + 2 * pair
        c = tl.load(turn, mask=ok & rotated, other=1.0)
        d = tl.load(turn + 1, mask=ok & rotated, other=0.0)
        re, im = _rotate(a, b, c, d)
        a = tl.where(rotated, re, a)
        b = tl.where(rotated, im, b)
        scale, inv_scale = _scales(tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1)), MIN_AMAX)
        tl.store(y_ptr + even, _fp4(a, scale, inv_scale).to(y_ptr.dtype.element_ty), mask=ok)
        tl.store(y_ptr + even + 1, _fp4(b, scale, inv_scale).to(y_ptr.dtype.element_ty), mask=ok)


def fake_quant_indexer(x: torch.Tensor, turns: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., C] (C % 32 == 0, fp32/bf16) → FP4-rounded x, same shape and dtype.

    With ``turns`` (complex64 [R, P], ``rope_turns``): x is fp32 [R, H, di], not yet rotated, and the result
    is ``fake_quant_indexer(apply_rope_(x, turns))`` (the same bits; x is left as it was), in one launch."""
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
    if turns is None:
        _fake_quant_kernel[(triton.cdiv(num_blocks, rows),)](
            x, y, x, num_blocks, 1, 1, 0, 0, ROWS=rows, BLOCK=BLOCK, MIN_AMAX=MIN_AMAX, ROPE=False
        )
        return y
    num_pairs = turns.shape[-1]
    if (
        x.dtype != torch.float32
        or turns.dtype != torch.complex64
        or x.ndim != 3
        or turns.ndim != 2
        or turns.shape[0] != x.shape[0]
        or 2 * num_pairs > channels
    ):
        raise ValueError(
            f"fake_quant_indexer with turns: x fp32 [R, H, di] and turns complex64 [R, P] with 2P ≤ di, "
            f"got {x.dtype} {tuple(x.shape)}, {turns.dtype} {tuple(turns.shape)}"
        )
    t = torch.view_as_real(turns)  # fp32 [R, P, 2], a view
    if t.stride(-1) != 1 or t.stride(-2) != 2:
        raise ValueError("fake_quant_indexer needs turns with contiguous pairs")
    blocks_per_head = channels // BLOCK
    _fake_quant_kernel[(triton.cdiv(num_blocks, rows),)](
        x,
        y,
        t,
        num_blocks,
        x.shape[1] * blocks_per_head,
        blocks_per_head,
        channels - 2 * num_pairs,
        t.stride(0),
        ROWS=rows,
        BLOCK=BLOCK,
        MIN_AMAX=MIN_AMAX,
        ROPE=True,
    )
    return y
