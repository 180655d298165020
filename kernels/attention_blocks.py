"""The sparse attention kernels' shared pieces (``kernels/decode_attention.py`` and
``kernels/prefill_attention.py``): exact dequantisation of FP8 window rows and FP4 entries in natural
channel order, the window and entry key loops, one online-softmax block, the epilogue (normalise,
undo-RoPE, store), and the launchers' alignment and block-size rules. Keep signatures stable: both
kernels call them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def _e4m3_to_f32(byte):
    """uint8 codes (any int type, 0..255) → fp32, exactly (no NaN codes occur in the caches)."""
    return byte.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1_to_f32_scaled(nibble):
    """4-bit e2m1 codes (int32 0..15; {0, .5, 1, 1.5, 2, 3, 4, 6}, bit 3 the sign) → fp32 value · 2^−14,
    exactly: the bits s|ee|m placed as fp16 s|000ee|m000000000 read 2^(e−15)·(1 + m/2) for e ≥ 1 and
    (m/2)·2^−14 for e = 0 (an fp16 subnormal); no compare or select."""
    bits = ((nibble & 8) << 12) | ((nibble & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _window_keys(codes, scale_bytes, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """codes [BLOCK_N, D] e4m3, scale_bytes [BLOCK_N, D/32] e8m0 → keys fp32 [BLOCK_N, D]."""
    scale = (scale_bytes.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    keys = tl.reshape(_e4m3_to_f32(codes), [BLOCK_N, D // 32, 32]) * scale[:, :, None]
    return tl.reshape(keys, [BLOCK_N, D])


@triton.jit
def _entry_keys(packed, scale_bytes, BLOCK_N: tl.constexpr, D: tl.constexpr):
    """packed [BLOCK_N, D/2] (byte i: channel 2i low nibble, 2i+1 high), scale_bytes [BLOCK_N, D/16]
    e4m3 (one per 16 channels = 8 bytes) → keys fp32 [BLOCK_N, D]."""
    scale = (_e4m3_to_f32(scale_bytes) * 16384.0)[:, :, None]  # · 2^14 undoes the decode's 2^−14, exactly
    nibbles = packed.to(tl.int32)
    lo = tl.reshape(_e2m1_to_f32_scaled(nibbles & 15), [BLOCK_N, D // 16, 8]) * scale
    hi = tl.reshape(_e2m1_to_f32_scaled(nibbles >> 4), [BLOCK_N, D // 16, 8]) * scale
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, D])


@triton.jit
def _attend_block(q, k, ok, m, l, acc, scale_log2e, precision: tl.constexpr):
    """One block of keys k [BLOCK_N, D] into the online softmax: logits in log2 units, invalid keys at −inf."""
    s = tl.dot(q, tl.trans(k), input_precision=precision) * scale_log2e  # [BLOCK_H, BLOCK_N]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(k.dtype), k, acc * alpha[:, None], input_precision=precision)
    return m_new, l, acc


@triton.jit
def _window_blocks(
    q,
    m,
    l,
    acc,
    ring_row,
    pos,
    ring_size,
    ring_stride_pos,
    scale_log2e,
    first,
    NUM_BLOCKS: tl.constexpr,
    WINDOW: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    precision: tl.constexpr,
):
    """Window blocks first … first + NUM_BLOCKS: positions pos−WINDOW+1+j, ascending, at ring index
    p mod ring_size; rows of D e4m3 codes then D/32 e8m0 scales."""
    n = tl.arange(0, BLOCK_N)
    for i in tl.range(0, NUM_BLOCKS, num_stages=NUM_STAGES):
        j = (first + i) * BLOCK_N + n
        p = pos - WINDOW + 1 + j
        ok = (j < WINDOW) & (p >= 0)
        key_row = ring_row + tl.where(ok, p % ring_size, 0) * ring_stride_pos  # [BLOCK_N]
        codes = tl.load(key_row[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0)
        # The D/32 scale bytes as a [BLOCK_N, 2 · D/32] load whose second half is masked off: ≥ 4 bytes
        # per thread (8 warps, BLOCK_N 32), which makes it a cp.async the pipeliner takes.
        c = tl.arange(0, D // 16)
        scale_bytes = tl.load(key_row[:, None] + D + c[None, :], mask=ok[:, None] & (c < D // 32)[None, :], other=0)
        scale_bytes = tl.split(tl.permute(tl.reshape(scale_bytes, [BLOCK_N, 2, D // 32]), [0, 2, 1]))[0]
        k = _window_keys(codes, scale_bytes, BLOCK_N, D).to(q.dtype)
        m, l, acc = _attend_block(q, k, ok, m, l, acc, scale_log2e, precision)
    return m, l, acc


@triton.jit
def _entry_blocks(
    q,
    m,
    l,
    acc,
    sel_row,
    pool_ptr,
    entries_per_block,
    pool_stride_block,
    pool_stride_entry,
    scale_log2e,
    first,
    NUM_BLOCKS: tl.constexpr,
    TOPK: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    precision: tl.constexpr,
):
    """Selected entries first · BLOCK_N …: pool slot sel (−1 none) is entry sel mod epb of block
    sel div epb; entries of D/2 packed e2m1 bytes then D/16 e4m3 scales."""
    n = tl.arange(0, BLOCK_N)
    for i in tl.range(0, NUM_BLOCKS, num_stages=NUM_STAGES):
        e = (first + i) * BLOCK_N + n
        sel = tl.load(sel_row + e, mask=e < TOPK, other=-1)
        ok = sel >= 0
        sel = tl.where(ok, sel, 0)
        key_row = (
            pool_ptr
            + (sel // entries_per_block).to(tl.int64) * pool_stride_block
            + (sel % entries_per_block) * pool_stride_entry
        )  # [BLOCK_N]
        packed = tl.load(key_row[:, None] + tl.arange(0, D // 2)[None, :], mask=ok[:, None], other=0)
        scale_bytes = tl.load(key_row[:, None] + D // 2 + tl.arange(0, D // 16)[None, :], mask=ok[:, None], other=0)
        k = _entry_keys(packed, scale_bytes, BLOCK_N, D).to(q.dtype)
        m, l, acc = _attend_block(q, k, ok, m, l, acc, scale_log2e, precision)
    return m, l, acc


@triton.jit
def _finish(
    acc,
    denom,
    pos,
    heads,
    h_ok,
    freqs_ptr,
    out_ptr,
    out_row,
    out_stride_h,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """Normalise acc [BLOCK_H, D], undo RoPE on the trailing ROPE_PAIRS channel pairs (angle pos · freqs), store.

    libdevice's cos/sin reduce any angle exactly (pos · freqs reaches 10^5 rad); the interpreter has
    no libdevice and uses numpy's through tl.cos/tl.sin.
    """
    HALF: tl.constexpr = D // 2
    oe, oo = tl.split(tl.reshape(acc / denom[:, None], [BLOCK_H, HALF, 2]))  # channels 2i, 2i + 1
    j = tl.arange(0, HALF) - (HALF - ROPE_PAIRS)
    is_rope = j >= 0
    f = tl.load(freqs_ptr + tl.where(is_rope, j, 0), mask=is_rope, other=0.0)
    angle = pos.to(tl.float32) * f  # the reference's fp32 product; 0 (cos 1, sin 0) off the rope pairs
    if LIBDEVICE:
        c = libdevice.cos(angle)[None, :]
        s = libdevice.sin(angle)[None, :]
    else:
        c = tl.cos(angle)[None, :]
        s = tl.sin(angle)[None, :]
    o = tl.reshape(tl.join(oe * c + oo * s, oo * c - oe * s), [BLOCK_H, D])
    ptrs = out_ptr + out_row + heads[:, None].to(tl.int64) * out_stride_h + tl.arange(0, D)[None, :]
    tl.store(ptrs, o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None])


def entry_block_n(block_n: int, dim: int) -> int:
    """The default ``block_n`` for FP4 entry blocks, raised to 32 below Flash's head dim.

    On the H200 (Triton 3.6) the compiled bf16-dot path of ``_entry_blocks`` at BLOCK_N 16 and D 64 is
    wrong for every row with a selected entry, at 2, 4 and 8 warps, while fp32 dots, BLOCK_N 32 and the
    window loop are right to bf16, and so is the interpreter with exact bf16 emulation: a compiled-code
    defect at that tile (docs/performance.md, the prefill attention defect; tests/kernels/diag_prefill_tiny.py).
    BLOCK_N 16 is verified only at D 512 (Flash, tests/kernels/test_prefill_attention.py), so it is kept
    only there."""
    return block_n if dim >= 512 else max(block_n, 32)


def _ring_align(ring: torch.Tensor) -> int:
    """The largest power of two ≤ 16 dividing every state slot's ring start (bytes): Flash's
    2,916,132-byte slots give 4, so window rows load as 4-byte words (still cp.async-eligible)."""
    align = 16
    while ring.stride(0) % align:
        align //= 2
    return align
