"""Sparse prefill attention: the rows of a prefill chunk over their sliding window (FP8 ring rows before
the chunk, this step's own FP8 K rows inside it) and their selected FP4 compressed entries, with the
attention sink and undo-RoPE (spec §3.5; ``TorchAttention.attend`` for every row of a step). Reference:
``kernels.reference.sparse_prefill_attention``.

Design. One program takes one query row and BLOCK_H heads (all 64 of Flash): the heads fill the MMA's
M dimension, since every head reads the same key latent (K = V, one per key). This is the decode
kernel's tile, and it is also FlashMLA's sparse-prefill tile, for a reason that holds here:

- The [64 heads, 512] fp32 accumulator already takes half the register file of an SM. A tile of
  BLOCK_M query rows × 64 heads cannot be held; a tile of BLOCK_M rows × 64/BLOCK_M heads (the
  "tiled flash attention with a causal-window mask") reads the union of the rows' windows,
  BLOCK_M + w − 1 keys, once per head block, i.e. BLOCK_M + w − 1 keys per row instead of w, and
  computes on all of them with (BLOCK_M − 1) / (BLOCK_M + w − 1) of the products masked off. With
  MQA-like sharing the heads already give each key its full reuse inside the tile.
- The window of row r and r + 1 share w − 1 keys and consecutive rows run as consecutive programs, so
  those reads come from L2; the selected entries differ per row (a union per tile would mask most of
  each row's products) and are gathered per row, as in decode.

So the prefill kernel differs from decode only in where a window key comes from: positions before the
request's first row this step (``first``) are read from the state slot's FP8 ring, the others from
``step_k``, this step's K rows in the ring's own format (e4m3 codes + e8m0 scales per 32 channels,
``quantize_fp8_cache``), so both dequantise bit-identically. Only a key's row pointers depend on its
source, so one window loop serves both (two loops, ring part then step part, spilled ~800 bytes at
the Flash shapes: more live ranges across loops). Rows of a request are consecutive with consecutive
positions (a prefill chunk): position p of row r's request sits in step row r − pos[r] + p.

What prefill adds over decode is reuse across rows: a key dequantised in the loop is dequantised once
per row that reads it, yet a window key serves w rows and an entry many of the chunk's rows. Offline
SASS (sm_90a, 8 warps, 3 stages, Flash shapes) puts the dequantisation at most of each loop: 1,031
instructions per 16 window keys and 899 per 16 FP4 entries (65 HGMMA each), against 610 per 16 / 749
per 32 entries for bf16 rows that the loop only gathers. Hence the two staged paths
(kernels/prefill_staging.py), each exact in bf16 and each behind a flag, the in-loop path staying for
steps too large to stage:

- ``staged=``: the entries of the step's requests at the source, dequantised once per source
  (``stage_entries``; 3.5× the bytes per key, from a set of context/ratio rows that stays in L2, e.g.
  16 MB at 32K). The kernel bench measured it faster than the in-loop dequantisation
  (docs/performance.md, "Kernels"); the engine stages when the requests hold at most
  ``services/worker/attention/triton_backend.STAGE_MAX_ENTRIES`` entries.
- ``staged_window=``: the window keys, dequantised once per layer and step (``stage_window``: each
  request's w − 1 ring rows before its first row, then the step's K rows, one launch) instead of by
  each of up to w rows. A request's segment holds its ring part right before its step rows, so the w
  keys of a row are consecutive staged rows ending at its own: the window loop becomes a plain row
  gather with no per-key source or format. The keys, blocks and order are the in-loop path's, so the
  result is bit-identical (tested ``==``); the engine stages up to ``STAGE_MAX_WINDOW_ROWS`` rows.

The ring must be read as it was before this step writes its own rows to it (``TorchAttention`` reads it
first, and so does ``stage_window``): a chunk longer than ring − w would overwrite ring positions that
its first rows still need.

Everything else (exact bf16 dequantisation, the online softmax with exp2, P in bf16 for the PV
product, the sink and the undo-RoPE epilogue) is the decode kernel's, from kernels/attention_blocks.py.
Graph-safe: shapes fixed per step; positions, first positions, slots and selections are
device tensors; invalid keys (negative positions, selected −1) are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import invariance
from kernels.attention_blocks import _attend_block, _entry_blocks, _finish, _ring_align, _window_keys, entry_block_n
from kernels.prefill_staging import stage_entries, stage_keys, stage_rows, stage_window

# The per-step staging (kernels/prefill_staging.py) travels with the kernel that reads it: one module per kernel set.
__all__ = ["sparse_prefill_attention", "stage_entries", "stage_keys", "stage_rows", "stage_window"]

_LOG2E = 1.4426950408889634


@triton.jit
def _staged_entry_blocks(
    q,
    m,
    l,
    acc,
    sel_row,
    keys_ptr,
    keys_stride,
    scale_log2e,
    TOPK: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    precision: tl.constexpr,
):
    """Selected entries already dequantised (``stage_entries``): row sel of keys [E, D] (−1 none)."""
    n = tl.arange(0, BLOCK_N)
    for i in tl.range(0, (TOPK + BLOCK_N - 1) // BLOCK_N, num_stages=NUM_STAGES):
        e = i * BLOCK_N + n
        sel = tl.load(sel_row + e, mask=e < TOPK, other=-1)
        ok = sel >= 0
        key_row = keys_ptr + tl.where(ok, sel, 0).to(tl.int64) * keys_stride  # [BLOCK_N]
        k = tl.load(key_row[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        m, l, acc = _attend_block(q, k, ok, m, l, acc, scale_log2e, precision)
    return m, l, acc


@triton.jit
def _staged_window_blocks(
    q,
    m,
    l,
    acc,
    win_ptr,
    last,
    win_stride,
    pos,
    scale_log2e,
    WINDOW: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    precision: tl.constexpr,
):
    """Window keys already dequantised (``stage_window``): position pos − WINDOW + 1 + j is row
    last − WINDOW + 1 + j of win [T, D], inside the row's request segment for every j (masked below 0)."""
    n = tl.arange(0, BLOCK_N)
    for b in tl.range(0, WINDOW, BLOCK_N, num_stages=NUM_STAGES):
        j = b + n
        ok = (j < WINDOW) & (pos - WINDOW + 1 + j >= 0)
        key_row = win_ptr + (last - WINDOW + 1 + j) * win_stride  # [BLOCK_N]
        k = tl.load(key_row[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0).to(q.dtype)
        m, l, acc = _attend_block(q, k, ok, m, l, acc, scale_log2e, precision)
    return m, l, acc


@triton.jit(do_not_specialize=("sel_stride_r",))
def _prefill_attention_kernel(
    q_ptr,
    kcode_ptr,
    kscale_ptr,
    ring_ptr,
    slots_ptr,
    pos_ptr,
    first_ptr,
    pool_ptr,
    sel_ptr,
    sink_ptr,
    freqs_ptr,
    win_ptr,
    win_rows_ptr,
    out_ptr,
    num_heads,
    q_stride_r,
    q_stride_h,
    kcode_stride_r,
    kscale_stride_r,
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
    staged_stride,
    win_stride,
    WINDOW: tl.constexpr,
    TOPK: tl.constexpr,
    D: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    RING_ALIGN: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    STAGED: tl.constexpr,
    STAGED_WINDOW: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    dot_ty = tl.float32 if DOT_FP32 else tl.bfloat16
    precision: tl.constexpr = "ieee" if DOT_FP32 else "tf32"  # bf16 operands ignore it
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads
    ch = tl.arange(0, D)
    groups = tl.arange(0, D // 32)
    n = tl.arange(0, BLOCK_N)

    q_ptrs = q_ptr + row * q_stride_r + heads[:, None].to(tl.int64) * q_stride_h + ch[None, :]
    q = tl.load(q_ptrs, mask=h_ok[:, None], other=0.0).to(dot_ty)  # [BLOCK_H, D]
    pos = tl.load(pos_ptr + row).to(tl.int32)
    first = tl.load(first_ptr + row).to(tl.int32)
    # RING_ALIGN (the launcher's check on the slot stride) lets the window loads vectorise, as in decode.
    ring_row = ring_ptr + tl.multiple_of(tl.load(slots_ptr + row).to(tl.int64) * ring_stride_slot, RING_ALIGN)
    sel_row = sel_ptr + row * sel_stride_r

    m = tl.full([BLOCK_H], -1.0e30, tl.float32)  # finite: a block with no valid key keeps alpha = 1
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)

    # Window positions p = pos − WINDOW + 1 + j, ascending, as bf16 rows staged once for the step
    # (STAGED_WINDOW), or dequantised here: those before ``first`` (the request's first row this
    # step) from the ring at p mod ring_size, the others from step row r − pos + p. Per key only its
    # row pointers differ, so one loop (one load) serves both sources.
    if STAGED_WINDOW:
        m, l, acc = _staged_window_blocks(
            q,
            m,
            l,
            acc,
            win_ptr,
            tl.load(win_rows_ptr + row).to(tl.int64),
            win_stride,
            pos,
            scale_log2e,
            WINDOW,
            D,
            BLOCK_N,
            NUM_STAGES,
            precision,
        )
    else:
        for b in tl.range(0, WINDOW, BLOCK_N, num_stages=NUM_STAGES):  # constexpr trips: pipelined gathers
            j = b + n
            p = pos - WINDOW + 1 + j
            ok = (j < WINDOW) & (p >= 0)
            in_step = p >= first
            k_row = row + tl.where(ok & in_step, p - pos, 0).to(tl.int64)  # [BLOCK_N] step rows, ≤ row
            ring_key = ring_row + tl.where(ok, p % ring_size, 0).to(tl.int64) * ring_stride_pos
            code_row = tl.where(in_step, kcode_ptr + k_row * kcode_stride_r, ring_key)  # [BLOCK_N]
            scale_row = tl.where(in_step, kscale_ptr + k_row * kscale_stride_r, ring_key + D)
            codes = tl.load(code_row[:, None] + ch[None, :], mask=ok[:, None], other=0)
            scale_bytes = tl.load(scale_row[:, None] + groups[None, :], mask=ok[:, None], other=0)
            k = _window_keys(codes, scale_bytes, BLOCK_N, D).to(dot_ty)
            m, l, acc = _attend_block(q, k, ok, m, l, acc, scale_log2e, precision)
    # Selected entries: one gathered row per key (selections differ per row): FP4 bytes dequantised here,
    # as in decode, or (STAGED) bf16 rows dequantised once per step, pool_ptr then being those rows.
    if STAGED:
        m, l, acc = _staged_entry_blocks(
            q, m, l, acc, sel_row, pool_ptr, staged_stride, scale_log2e, TOPK, D, BLOCK_N, NUM_STAGES, precision
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
            0,
            (TOPK + BLOCK_N - 1) // BLOCK_N,
            TOPK,
            D,
            BLOCK_N,
            NUM_STAGES,
            precision,
        )

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


def sparse_prefill_attention(
    q: torch.Tensor,
    step_k: tuple[torch.Tensor, torch.Tensor],
    ring: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    first: torch.Tensor,
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
    num_warps: int | None = None,
    num_stages: int = 3,
    dot_fp32: bool = False,
    staged: torch.Tensor | None = None,
    staged_window: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Same arguments and result as ``kernels.reference.sparse_prefill_attention``.

    q [R, H, D] (post-RoPE, last dim contiguous); step_k = (float8_e4m3fn [R, D], float8_e8m0fnu
    [R, D/32]), ``quantize_fp8_cache`` of this step's post-RoPE K (or the same bytes as uint8);
    ring uint8 [slots, ring_size, D + D/32] before this step's writes; state_slots, positions,
    first [R] (first = the position of the row's request's first row this step; a request's rows are
    consecutive, positions ascending by one); kv_pool uint8 [blocks, epb, D/2 + D/16]; selected int32
    [R, k] pool slots (−1 = none; k = 0 for window-only layers); sink [H] fp32; freqs [P/2] fp32.

    ``staged`` [E, D] (bf16, or fp32 for tests): the entries dequantised once for the step
    (``stage_entries``); ``selected`` then holds row indices into it and ``kv_pool`` is not read.
    ``staged_window`` (keys [T, D], rows int32 [R]): the window keys dequantised once for the step
    (``stage_window``, in the dot dtype: bf16, fp32 with ``dot_fp32``); ``step_k`` and ``ring`` are
    then not read, and the result is the in-loop dequantisation's, bit for bit (the same keys, blocks
    and order).
    """
    num_rows, num_heads, dim = q.shape
    k_values, k_scales = (t.view(torch.uint8) for t in step_k)
    topk = selected.shape[1]
    if dim % 32 or dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two ≥ 32, got {dim}")
    if staged is not None:
        if staged.shape[-1] != dim or staged.stride(-1) != 1:
            raise ValueError(f"staged entries must be [E, {dim}] with a contiguous last dim, got {list(staged.shape)}")
        kv_pool = staged.view(-1, 1, dim)  # only its pointer and row stride are used
    elif kv_pool.shape[-1] != dim // 2 + dim // 16:
        raise ValueError(f"entries {kv_pool.shape[-1]} do not fit head_dim {dim}")
    if ring.shape[-1] != dim + dim // 32:
        raise ValueError(f"ring rows {ring.shape[-1]} do not fit head_dim {dim}")
    if k_values.shape != (num_rows, dim) or k_scales.shape != (num_rows, dim // 32):
        raise ValueError(
            f"step_k must be ([{num_rows}, {dim}], [{num_rows}, {dim // 32}]), got "
            f"({list(k_values.shape)}, {list(k_scales.shape)})"
        )
    if window >= ring.shape[1]:
        raise ValueError(f"window {window} must be below the ring size {ring.shape[1]}")
    for name, t in (("q", q), ("ring", ring), ("kv_pool", kv_pool), ("step_k", k_values), ("step_k scales", k_scales)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    win_keys, win_rows = (q, positions) if staged_window is None else staged_window  # placeholders: never read
    if staged_window is not None and (
        win_keys.shape[-1] != dim
        or win_keys.stride(-1) != 1
        or win_rows.shape != (num_rows,)
        or win_rows.dtype != torch.int32
    ):
        raise ValueError(
            f"staged_window must be ([T, {dim}] with a contiguous last dim, int32 [{num_rows}]), got "
            f"({list(win_keys.shape)}, {win_rows.dtype} {list(win_rows.shape)})"
        )
    selected = selected if selected.dtype == torch.int32 else selected.to(torch.int32)
    if selected.stride(-1) != 1:
        selected = selected.contiguous()
    out = torch.empty_like(q) if out is None else out
    block_h = block_h or min(64, max(16, triton.next_power_of_2(num_heads)))
    # 0 spills at the Flash shapes (sm_90a, 8 warps, 3 stages): BLOCK_N 16 with FP4 entries, 32 with staged ones.
    if invariance.active() and block_n is None:  # decode attention's key blocks (kernels/invariance.py)
        block_n = invariance.ATTENTION_BLOCK_N
    explicit_block_n = block_n is not None
    block_n = block_n or (16 if staged is None else 32)
    if dot_fp32:  # fp32 q and keys in shared memory leave no room for staged key bytes (as in decode)
        num_stages = 1
    if num_warps is None:
        num_warps = 8 if block_h * dim >= 16384 else 4
    if staged is None and not explicit_block_n:
        block_n = entry_block_n(block_n, dim)
    if num_rows == 0:
        return out
    _prefill_attention_kernel[(num_rows, triton.cdiv(num_heads, block_h))](
        q,
        k_values,
        k_scales,
        ring,
        state_slots,
        positions,
        first,
        kv_pool,
        selected,
        sink,
        freqs,
        win_keys,
        win_rows,
        out,
        num_heads,
        q.stride(0),
        q.stride(1),
        k_values.stride(0),
        k_scales.stride(0),
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
        0 if staged is None else staged.stride(0),
        win_keys.stride(0),
        WINDOW=window,
        TOPK=topk,
        D=dim,
        ROPE_PAIRS=freqs.shape[0],
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        RING_ALIGN=_ring_align(ring),
        NUM_STAGES=num_stages,
        STAGED=staged is not None,
        STAGED_WINDOW=staged_window is not None,
        DOT_FP32=dot_fp32,
        LIBDEVICE=q.is_cuda,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
