"""Keys dequantised once per step for sparse prefill attention (``kernels/prefill_attention.py``), whose
loops then only gather bf16 rows: a key read by many rows of a chunk is dequantised once, not once per row.

- ``stage_entries`` / ``stage_keys`` / ``stage_rows``: every compressed entry the step's requests can
  select at a KV source (FP4 e2m1 × e4m3 scale: ≤ 5 significant bits, exact in bf16), torch ops.
- ``stage_window``: the sliding-window keys of one layer, one launch. Request i's segment holds its
  WINDOW − 1 ring positions before its first row this step (read from the ring BEFORE this step
  writes it), then its step rows, so the WINDOW keys of any row are consecutive rows of the output,
  ending at ``rows[r]``: one gather, no per-key source. e4m3 (≤ 4 significant bits) × 2^k (e8m0) is
  exact in bf16 for every scale the cache writes (2^−22 and up: ``quant.quantize_fp8_cache``), and
  the kernel dequantises with the attention loop's own ``_window_keys`` and casts to the key dtype as
  that loop does, so staged and in-loop keys are the same bits whatever the scale.

Fixed shapes from host facts (rows, requests, window), device ops only: graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_blocks import _window_keys

RING_BLOCK_N = 16  # ring rows per step of a request's first-row program: [16, 512] fp32 is 64 registers/thread


@triton.jit
def _stage_window_kernel(
    kcode_ptr,
    kscale_ptr,
    ring_ptr,
    slots_ptr,
    pos_ptr,
    first_ptr,
    req_ptr,
    out_ptr,
    rows_ptr,
    kcode_stride_r,
    kscale_stride_r,
    ring_stride_slot,
    ring_stride_pos,
    ring_size,
    out_stride,
    WINDOW: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program per step row: its own key to ``rows[r]``; a request's first row also its ring part."""
    row = tl.program_id(0).to(tl.int64)
    ch = tl.arange(0, D)
    groups = tl.arange(0, D // 32)
    key_ty = out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + row).to(tl.int32)
    first = tl.load(first_ptr + row).to(tl.int32)
    # Request i's segment starts at its first step row + i · (WINDOW − 1): its ring rows come first.
    last = row + (WINDOW - 1) * (tl.load(req_ptr + row).to(tl.int64) + 1)
    tl.store(rows_ptr + row, last.to(tl.int32))
    codes = tl.load(kcode_ptr + row * kcode_stride_r + ch)
    scale_bytes = tl.load(kscale_ptr + row * kscale_stride_r + groups)
    k = _window_keys(codes[None, :], scale_bytes[None, :], 1, D)
    tl.store(out_ptr + last * out_stride + ch[None, :], k.to(key_ty))
    if pos == first:  # the request's first row: positions first − WINDOW + 1 … first − 1 from the ring
        ring_row = ring_ptr + tl.load(slots_ptr + row).to(tl.int64) * ring_stride_slot
        n = tl.arange(0, BLOCK_N)
        for b in range(0, WINDOW - 1, BLOCK_N):
            j = b + n
            live = j < WINDOW - 1
            p = first - (WINDOW - 1) + j
            ok = live & (p >= 0)  # positions before 0 stay zero rows (the attention masks them)
            key = ring_row + tl.where(ok, p % ring_size, 0).to(tl.int64) * ring_stride_pos
            ring_codes = tl.load(key[:, None] + ch[None, :], mask=ok[:, None], other=0)
            ring_scales = tl.load(key[:, None] + D + groups[None, :], mask=ok[:, None], other=0)
            ring_keys = _window_keys(ring_codes, ring_scales, BLOCK_N, D)
            dst = out_ptr + (last - (WINDOW - 1) + j).to(tl.int64) * out_stride
            tl.store(dst[:, None] + ch[None, :], ring_keys.to(key_ty), mask=live[:, None])


def stage_window(
    step_k: tuple[torch.Tensor, torch.Tensor],
    ring: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    first: torch.Tensor,
    window: int,
    row_requests: torch.Tensor,
    num_requests: int,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The window keys of one layer's step dequantised once, for ``sparse_prefill_attention(staged_window=...)``:
    (keys ``dtype`` [R + num_requests · (window − 1), D], rows int32 [R]: row r's own key; its window is
    keys[rows[r] − window + 1 … rows[r]], rows at positions below 0 being zero).

    step_k, ring, state_slots, positions, first: as ``sparse_prefill_attention`` takes them (the ring
    before this step's writes); row_requests [R] each row's request, rows of request i following those
    of requests below i (``StepBatch``'s order), all below ``num_requests``.
    """
    k_values, k_scales = (t.view(torch.uint8) for t in step_k)
    num_rows, dim = k_values.shape
    if dim % 32 or dim & (dim - 1):
        raise ValueError(f"head_dim must be a power of two ≥ 32, got {dim}")
    if ring.shape[-1] != dim + dim // 32 or k_scales.shape != (num_rows, dim // 32):
        raise ValueError(f"ring rows {ring.shape[-1]} / step_k scales {list(k_scales.shape)} do not fit head_dim {dim}")
    if window >= ring.shape[1]:
        raise ValueError(f"window {window} must be below the ring size {ring.shape[1]}")
    for name, t in (("ring", ring), ("step_k", k_values), ("step_k scales", k_scales)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} needs a contiguous last dimension")
    keys = torch.empty(num_rows + num_requests * (window - 1), dim, dtype=dtype, device=k_values.device)
    rows = torch.empty(num_rows, dtype=torch.int32, device=k_values.device)
    if num_rows:
        _stage_window_kernel[(num_rows,)](
            k_values,
            k_scales,
            ring,
            state_slots,
            positions,
            first,
            row_requests,
            keys,
            rows,
            k_values.stride(0),
            k_scales.stride(0),
            ring.stride(0),
            ring.stride(1),
            ring.shape[1],
            keys.stride(0),
            WINDOW=window,
            D=dim,
            BLOCK_N=RING_BLOCK_N,
            num_warps=4,
        )
    return keys, rows


def stage_entries(
    kv_pool: torch.Tensor,
    block_tables: torch.Tensor,
    entries: torch.Tensor,
    row_requests: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every entry of the step's requests dequantised once, for ``sparse_prefill_attention(staged=...)``:
    (``stage_keys``, ``stage_rows``).

    kv_pool uint8 [blocks, epb, D/2 + D/16]; block_tables [N, width]; entries [R, k] each row's entry
    ids (−1 none); row_requests [R]. Returns (keys ``dtype`` [N · width · epb, D], int32 [R, k] rows
    of it). e2m1 × e4m3 has ≤ 5 significant bits, so bf16 holds the keys exactly: the same products
    as the in-loop dequantisation. Fixed shapes, device ops: graph-safe.
    """
    keys = stage_keys(kv_pool, block_tables, dtype)
    return keys, stage_rows(entries, row_requests, block_tables.shape[1] * kv_pool.shape[1])


def stage_keys(kv_pool: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The entries of ``block_tables`` [N, width]'s blocks dequantised: ``dtype`` [N · width · epb, D]."""
    from model.deepseek_v41.quant import COMPRESSED_KV_BLOCK, dequantize_fp4_cache

    half = kv_pool.shape[2] - kv_pool.shape[2] // 9  # D/2 of D/2 + D/16 bytes
    raw = kv_pool[block_tables.long()].flatten(0, 2)  # [N · width · epb, D/2 + D/16]
    keys = dequantize_fp4_cache(raw[:, :half], raw[:, half:].view(torch.float8_e4m3fn), COMPRESSED_KV_BLOCK)
    return keys.to(dtype)


def stage_rows(entries: torch.Tensor, row_requests: torch.Tensor, entries_per_request: int) -> torch.Tensor:
    """Entry ids [R, k] (−1 none) of each row's request → int32 rows of ``stage_keys``' output."""
    index = torch.where(entries >= 0, row_requests.long()[:, None] * entries_per_request + entries.long(), -1)
    return index.to(torch.int32)
