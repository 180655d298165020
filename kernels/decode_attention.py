"""Sparse decode attention: one query per row over its FP8 window ring and its selected FP4
compressed entries, with the attention sink and undo-RoPE (spec §3.5; the cache bytes exactly as
``services/worker/state/cache_engine.py`` stores them). Reference: ``kernels.reference.sparse_decode_attention``.

One key latent serves as key and value (K = V, MLA-style) and is shared by every head, so a program
takes one row and BLOCK_H heads (all 64 of Flash by default): each key is read from HBM once per
row, dequantised once in registers and used by all the heads as a [BLOCK_H, D] × [D, BLOCK_N] and
a [BLOCK_H, BLOCK_N] × [BLOCK_N, D] tensor-core product (bf16 operands, fp32 accumulation, online
softmax in fp32 with exp2).

Keys are dequantised in natural channel order, [BLOCK_N, D]: an FP8 window row's D codes with its
D/32 e8m0 scales broadcast over 32-channel groups, an FP4 entry's nibbles (channel 2i low, 2i+1
high) interleaved by ``tl.join`` + reshape, scaled per 16 channels. Loads go straight from the cache
bytes (16-byte vectors for the pool, 4-byte for Flash's 4-byte-aligned state slots: ``RING_ALIGN``),
which is what lets Triton's software pipeliner turn them into cp.async copies one to two blocks
ahead of their use (``num_stages``); the loops are ``tl.range`` loops with constant trip counts
(the pipeliner handles only scf.for loops, and the interpreter only constant bounds). Undo-RoPE
splits the output into (even, odd) channel halves in the epilogue.

Dequantisation is exact in bf16: e4m3 (3 mantissa bits) times a power-of-two e8m0 scale, and e2m1
(1 bit) times an e4m3 scale (≤ 5 significant bits in all), so the QK products equal the
reference's fp32 ones for bf16 queries; the one rounding the reference lacks is P → bf16 before
the PV product (standard flash-attention practice; ``dot_fp32=True`` keeps P in fp32, for tests).

Graph-safe: shapes are fixed per batch; each row's position, state slot and selected pool slots
are device tensors, and invalid keys (window positions < 0, selected slot −1) are masked, so rows
with fewer keys need no host-side handling. For small batches (rows ≤ a quarter of the SMs) the
keys of a row are split over ``splits`` programs (flash-decoding), each taking window blocks or
entry blocks; a second kernel merges the partial (max, sum, accumulator) with the sink and applies
undo-RoPE. The key loops, the online softmax step and the epilogue live in
``kernels/attention_blocks.py``, shared with ``kernels/prefill_attention.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import invariance
from kernels.attention_blocks import (
    _entry_blocks,
    _finish,
    _ring_align,
    _window_blocks,
    entry_block_n,
)
from kernels.device import num_sms

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=("sel_stride_r",))
def _decode_attention_kernel(
    q_ptr,
    ring_ptr,
    slots_ptr,
    pos_ptr,
    pool_ptr,
    sel_ptr,
    sink_ptr,
    freqs_ptr,
    out_ptr,
    part_acc_ptr,
    part_ml_ptr,
    num_heads,
    q_stride_r,
    q_stride_h,
    ring_stride_slot,
    ring_stride_pos,
    pool_stride_block,
    pool_stride_entry,
    sel_stride_r,
    out_stride_r,
    out_stride_h,
    ring_size,
    entries_per_block,
    scale_log2e,
    WINDOW: tl.constexpr,
    TOPK: tl.constexpr,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    KEYS: tl.constexpr,
    RING_ALIGN: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    WIN_BLOCKS: tl.constexpr = (WINDOW + BLOCK_N - 1) // BLOCK_N
    ENT_BLOCKS: tl.constexpr = (TOPK + BLOCK_N - 1) // BLOCK_N
    precision: tl.constexpr = "ieee" if DOT_FP32 else "tf32"  # bf16 operands ignore it
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    WIN_SPLITS: tl.constexpr = (WIN_BLOCKS + BLOCKS_PER_SPLIT - 1) // BLOCKS_PER_SPLIT
    first = tl.program_id(2) * BLOCKS_PER_SPLIT  # this split's first block of its kind of keys (KEYS 1, 2)
    # Partials' split index: the window's splits first, then the entries'.
    split = tl.program_id(2) + (WIN_SPLITS if KEYS == 2 else 0)
    h_ok = heads < num_heads
    ch = tl.arange(0, D)

    q_ptrs = q_ptr + row * q_stride_r + heads[:, None].to(tl.int64) * q_stride_h + ch[None, :]
    q = tl.load(q_ptrs, mask=h_ok[:, None], other=0.0).to(tl.float32 if DOT_FP32 else tl.bfloat16)  # [BLOCK_H, D]
    pos = tl.load(pos_ptr + row).to(tl.int32)
    # The row's ring: RING_ALIGN (the launcher's check) is what lets the key loads below vectorise,
    # and what makes them eligible for cp.async (≥ 4 bytes), hence for the loop's software pipeline.
    ring_row = ring_ptr + tl.multiple_of(tl.load(slots_ptr + row).to(tl.int64) * ring_stride_slot, RING_ALIGN)
    sel_row = sel_ptr + row * sel_stride_r

    m = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: a block with no valid key keeps alpha = 1
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)

    # Keys in blocks of BLOCK_N: the window's, then the entries'. One program takes all of them
    # (KEYS 0, SPLITS 1) or BLOCKS_PER_SPLIT blocks of one kind (KEYS 1: window, 2: entries; one launch
    # each, so no kernel holds both pipelined loops behind a branch: that spilled). KEYS 3: one block
    # per split, both kinds in one launch (loops of one iteration are not pipelined: no spill).
    # The loops have constexpr trip counts (blocks past the end are masked): scf.for loops, which
    # Triton software-pipelines (block b+1's raw bytes in flight by cp.async while block b is
    # dequantised and multiplied), and which the interpreter can run.
    if KEYS == 0:
        m, l, acc = _window_blocks(
            q,
            m,
            l,
            acc,
            ring_row,
            pos,
            ring_size,
            ring_stride_pos,
            scale_log2e,
            0,
            WIN_BLOCKS,
            WINDOW,
            D,
            BLOCK_N,
            NUM_STAGES,
            precision,
        )
        m, l, acc = _entry_blocks(
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
            0,
            ENT_BLOCKS,
            TOPK,
            D,
            BLOCK_N,
            NUM_STAGES,
            precision,
        )
    elif KEYS == 1:
        m, l, acc = _window_blocks(
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
            min(BLOCKS_PER_SPLIT, WIN_BLOCKS),
            WINDOW,
            D,
            BLOCK_N,
            NUM_STAGES,
            precision,
        )
    elif KEYS == 2:
        m, l, acc = _entry_blocks(
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
            min(BLOCKS_PER_SPLIT, ENT_BLOCKS),
            TOPK,
            D,
            BLOCK_N,
            NUM_STAGES,
            precision,
        )
    elif split < WIN_BLOCKS:
        m, l, acc = _window_blocks(
            q,
            m,
            l,
            acc,
            ring_row,
            pos,
            ring_size,
            ring_stride_pos,
            scale_log2e,
            split,
            1,
            WINDOW,
            D,
            BLOCK_N,
            NUM_STAGES,
            precision,
        )
    else:
        m, l, acc = _entry_blocks(
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
            split - WIN_BLOCKS,
            1,
            TOPK,
            D,
            BLOCK_N,
            NUM_STAGES,
            precision,
        )

    if SPLITS == 1:
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        denom = l + tl.exp2(sink - m)
        _finish(
            acc,
            denom,
            pos,
            heads,
            h_ok,
            freqs_ptr,
            out_ptr,
            row * out_stride_r,
            out_stride_h,
            BLOCK_H,
            D,
            ROPE_PAIRS,
            LIBDEVICE,
        )
    else:
        # Partials: acc [R, SPLITS, H, D], (m, l) [R, SPLITS, H, 2].
        rs = row * SPLITS + split
        tl.store(part_acc_ptr + (rs * num_heads + heads[:, None]) * D + ch[None, :], acc, mask=h_ok[:, None])
        ml_ptrs = part_ml_ptr + (rs * num_heads + heads) * 2
        tl.store(ml_ptrs, m, mask=h_ok)
        tl.store(ml_ptrs + 1, l, mask=h_ok)


@triton.jit
def _combine_kernel(
    part_acc_ptr,
    part_ml_ptr,
    pos_ptr,
    sink_ptr,
    freqs_ptr,
    out_ptr,
    num_heads,
    out_stride_r,
    out_stride_h,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """Merge one row's SPLITS partials for BLOCK_H heads: a loop over the splits (not unrolled)."""
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    ch = tl.arange(0, D)
    sp = tl.arange(0, BLOCK_S)
    ml = part_ml_ptr + ((row * SPLITS + sp[None, :]) * num_heads + heads[:, None]) * 2  # [BLOCK_H, BLOCK_S]
    ml_ok = h_ok[:, None] & (sp[None, :] < SPLITS)
    m_all = tl.load(ml, mask=ml_ok, other=-1.0e30)
    m = tl.max(m_all, axis=1)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    denom = tl.exp2(sink - m) + tl.sum(tl.exp2(m_all - m[:, None]) * tl.load(ml + 1, mask=ml_ok, other=0.0), axis=1)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    for s in range(SPLITS):
        rs = row * SPLITS + s
        w = tl.exp2(tl.load(part_ml_ptr + (rs * num_heads + heads) * 2, mask=h_ok, other=-1.0e30) - m)
        acc += w[:, None] * tl.load(
            part_acc_ptr + (rs * num_heads + heads[:, None]) * D + ch[None, :], mask=h_ok[:, None], other=0.0
        )
    pos = tl.load(pos_ptr + row).to(tl.int32)
    _finish(
        acc,
        denom,
        pos,
        heads,
        h_ok,
        freqs_ptr,
        out_ptr,
        row * out_stride_r,
        out_stride_h,
        BLOCK_H,
        D,
        ROPE_PAIRS,
        LIBDEVICE,
    )


def sparse_decode_attention(
    q: torch.Tensor,
    ring: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    kv_pool: torch.Tensor,
    selected: torch.Tensor,
    sink: torch.Tensor,
    freqs: torch.Tensor,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int = 3,
    dot_fp32: bool = False,
) -> torch.Tensor:
    """Same arguments and result as ``kernels.reference.sparse_decode_attention``.

    q [R, H, D] (last dim contiguous); ring uint8 [slots, ring_size, D + D/32] and kv_pool uint8
    [blocks, epb, D/2 + D/16] (the cache engine's strided views, last dim contiguous); state_slots,
    positions [R]; selected int32 [R, k] pool slots (−1 = none); sink [H] fp32; freqs [P/2] fp32.
    ``splits`` (default: enough programs for the GPU at small batches) divides each row's key
    blocks among programs, merged by a second kernel.
    """
    num_rows, num_heads, dim = q.shape
    topk = selected.shape[1]
    rope_pairs = freqs.shape[0]
    if dim % 32 or dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two ≥ 32, got {dim}")
    if ring.shape[-1] != dim + dim // 32 or kv_pool.shape[-1] != dim // 2 + dim // 16:
        raise ValueError(f"ring rows {ring.shape[-1]} / entries {kv_pool.shape[-1]} do not fit head_dim {dim}")
    if ring.stride(-1) != 1 or kv_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("q, ring and kv_pool need a contiguous last dimension")
    selected = selected if selected.dtype == torch.int32 else selected.to(torch.int32)
    if selected.stride(-1) != 1:
        selected = selected.contiguous()
    out = torch.empty_like(q) if out is None else out
    block_h = block_h or min(64, max(16, triton.next_power_of_2(num_heads)))
    head_blocks = triton.cdiv(num_heads, block_h)
    if invariance.active():  # one program per row, prefill attention's key blocks (kernels/invariance.py)
        splits = 1 if splits is None else splits
        block_n = invariance.ATTENTION_BLOCK_N if block_n is None else block_n
    if splits is None:
        # From the rows' power of two: SPLITS and BLOCKS_PER_SPLIT are constexprs, so eager steps of any row count
        # take the few variants of the power-of-two sizes (the graph sizes up to 32 rows are those already).
        programs = triton.next_power_of_2(num_rows) * head_blocks
        splits = _default_splits(window, topk, block_n or 32, programs, num_sms(q.device, off_gpu=8))
    # 64-key blocks when a program takes a whole row; 32 when split (the entries-only kernel's
    # pipelined loop spills at 64: 384 bytes, sm_90a ptxas)
    explicit_block_n = block_n is not None  # tests pick small blocks on purpose (interpreted)
    block_n = block_n or (64 if splits == 1 else 32)
    if dot_fp32:  # fp32 q and keys: 32-key blocks, and no shared memory left for staged key bytes
        block_n, num_stages = min(block_n, 32), 1
    if num_warps is None:
        num_warps = 8 if block_h * dim >= 16384 else 4
    if not explicit_block_n:
        block_n = entry_block_n(block_n, dim)
    win_blocks, ent_blocks = triton.cdiv(window, block_n), triton.cdiv(topk, block_n)
    total_blocks = win_blocks + ent_blocks
    splits = min(splits, total_blocks)
    per_split = triton.cdiv(total_blocks, splits)
    # A split takes window blocks or entry blocks, not both: (KEYS, number of splits) per launch.
    if splits == 1:
        launches = [(0, 1)]
    elif per_split == 1:
        launches = [(3, total_blocks)]
    else:
        launches = [(1, triton.cdiv(win_blocks, per_split)), (2, triton.cdiv(ent_blocks, per_split))]
    splits = sum(n for _, n in launches)
    per_split = total_blocks if splits == 1 else per_split
    if splits > 1:
        part_acc = torch.empty(num_rows, splits, num_heads, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_rows, splits, num_heads, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out  # unused
    for keys, num_splits in launches:
        if num_splits == 0:
            continue
        _decode_attention_kernel[(num_rows, head_blocks, num_splits)](
            q,
            ring,
            state_slots,
            positions,
            kv_pool,
            selected,
            sink,
            freqs,
            out,
            part_acc,
            part_ml,
            num_heads,
            q.stride(0),
            q.stride(1),
            ring.stride(0),
            ring.stride(1),
            kv_pool.stride(0),
            kv_pool.stride(1),
            selected.stride(0),
            out.stride(0),
            out.stride(1),
            ring.shape[1],
            kv_pool.shape[1],
            float(scale) * _LOG2E,
            WINDOW=window,
            TOPK=topk,
            D=dim,
            ROPE_PAIRS=rope_pairs,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            SPLITS=splits,
            BLOCKS_PER_SPLIT=per_split,
            KEYS=keys,
            RING_ALIGN=_ring_align(ring),
            NUM_STAGES=num_stages,
            DOT_FP32=dot_fp32,
            LIBDEVICE=q.is_cuda,
            num_warps=num_warps,
            num_stages=num_stages,
        )
    if splits > 1:
        combine_h = 4
        _combine_kernel[(num_rows, triton.cdiv(num_heads, combine_h))](
            part_acc,
            part_ml,
            positions,
            sink,
            freqs,
            out,
            num_heads,
            out.stride(0),
            out.stride(1),
            D=dim,
            ROPE_PAIRS=rope_pairs,
            SPLITS=splits,
            BLOCK_H=combine_h,
            BLOCK_S=triton.next_power_of_2(splits),
            LIBDEVICE=q.is_cuda,
            num_warps=4,
        )
    return out


def _default_splits(window: int, topk: int, block_n: int, num_programs: int, num_sms: int) -> int:
    """Splits per row: 1 unless the rows fill at most a quarter of the SMs (above that, whole rows beat
    splits on the H200: docs/kernel-notes.md, sparse decode attention); else the fewest blocks per split
    that keep every program in one wave (R = 1: 20 one-block splits)."""
    win_blocks, ent_blocks = triton.cdiv(window, block_n), triton.cdiv(topk, block_n)
    if 4 * num_programs > num_sms:
        return 1
    for per_split in range(1, win_blocks + ent_blocks + 1):
        programs = num_programs * (triton.cdiv(win_blocks, per_split) + triton.cdiv(ent_blocks, per_split))
        if programs <= num_sms:
            return triton.cdiv(win_blocks + ent_blocks, per_split)
    return 1
