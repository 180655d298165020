"""Per-row top-k of fp32 scores with ties to the lower index, for the indexer (``kernels/indexer.py``):
the set ``model/deepseek_v41/indexer.py``'s ``select_entries`` / ``candidate_mask`` keep (a stable
descending sort's first k, −∞ never kept), as ascending int32 indices with −1 padding or a uint8 mask.

One program per row holds the row in registers as order-preserving 32-bit keys and finds the k-th
largest key t by a bitwise binary search (the largest t with #{key ≥ t} ≥ k, one counting pass per
bit from the top, stopping as soon as exactly k keys are ≥ the prefix: ~15–20 passes on real
scores). Kept: every key > t and the first k − #{key > t} keys equal to t (an index bound found by
the same kind of search, only when some ties are left out). Compaction (default): each kept column
takes a slot with an atomic add, then the program sorts its ≤ k slots (tl.sort of BLOCK_K ints),
which costs ~6× fewer instructions than prefix sums over the row (``atomic=False``, kept as the
alternative). No host sync; the per-row slot counters are a zeroed [R] int32 buffer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _order_key(s):
    """fp32 → uint32 with u(a) < u(b) iff a < b; −0 maps with +0 (the reference's sort ties them)."""
    bits = tl.where(s == 0.0, 0.0, s).to(tl.uint32, bitcast=True)
    sign = tl.full([], 1, tl.uint32) << 31
    return tl.where((bits & sign) != 0, bits ^ tl.full([], 0xFFFFFFFF, tl.uint32), bits | sign)


@triton.jit(do_not_specialize=("width", "out_width", "scores_stride_r", "out_stride_r"))
def _select_kernel(
    scores_ptr,
    out_ptr,
    count_ptr,
    width,
    k,
    out_width,
    scores_stride_r,
    out_stride_r,
    BLOCK_W: tl.constexpr,
    LOG_W: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr,
    MASK_OUT: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    scores_row = scores_ptr + row * scores_stride_r
    out_row = out_ptr + row * out_stride_r
    j = tl.arange(0, BLOCK_W)
    u = _order_key(tl.load(scores_row + j, mask=j < width, other=float("-inf")))  # the row, in registers
    neg_inf = tl.full([], 0x007FFFFF, tl.uint32)  # u(−∞)
    kk = tl.minimum(k, tl.sum((u > neg_inf).to(tl.int32)))  # never pick a −∞ entry
    # The largest t with #{u ≥ t} ≥ kk, bit by bit from the top; #{u ≥ t} = kk ends it early.
    t = tl.full([], 0, tl.uint32)
    bit = 31
    done = 0
    while (bit >= 0) & (done == 0):
        cand = t | (tl.full([], 1, tl.uint32) << tl.cast(bit, tl.uint32))
        c = tl.sum((u >= cand).to(tl.int32))
        t = tl.where(c >= kk, cand, t)
        done = (c == kk).to(tl.int32)
        bit -= 1
    need = kk - tl.sum((u > t).to(tl.int32))  # ties at t, taken in index order
    if ATOMIC or MASK_OUT:
        # Membership without a scan: the ties kept are those below index bound, the largest b with
        # #{u = t, j < b} ≤ need, found bit by bit when only part of the ties is kept (rare).
        eq = u == t
        bound = BLOCK_W
        if need < tl.sum(eq.to(tl.int32)):
            bound = 0
            for sh in tl.static_range(LOG_W, -1, -1):
                cand = bound + (1 << sh)
                c = tl.sum((eq & (j < cand)).to(tl.int32))
                bound = tl.where(c <= need, cand, bound)
        sel = (u > t) | (eq & (j < bound))
        if MASK_OUT:
            tl.store(out_row + j, sel.to(tl.uint8), mask=j < width)
        else:
            # Each kept column takes a slot in any order, then one program-wide sort of the ≤ k slots.
            slot = tl.atomic_add(count_ptr + row + 0 * j, 1, mask=sel, sem="relaxed")
            tl.store(out_row + slot, j.to(tl.int32), mask=sel)
            tl.debug_barrier()  # this program's slot writes are visible to all its threads
            i = tl.arange(0, BLOCK_K)
            picked = tl.sort(tl.load(out_row + i, mask=i < kk, other=2147483647))
            tl.store(out_row + i, tl.where(i < kk, picked, -1), mask=i < out_width)
    else:
        # Compaction in index order by prefix sums, a chunk at a time (the row again, from L2).
        taken = 0
        ties = 0
        for c0 in range(0, BLOCK_W, CHUNK):
            i = c0 + tl.arange(0, CHUNK)
            v = _order_key(tl.load(scores_row + i, mask=i < width, other=float("-inf")))
            eq = (v == t).to(tl.int32)
            sel = (v > t) | ((eq != 0) & (ties + tl.cumsum(eq, 0) - eq < need))
            slot = taken + tl.cumsum(sel.to(tl.int32), 0) - 1
            tl.store(out_row + slot, i.to(tl.int32), mask=sel)
            taken += tl.sum(sel.to(tl.int32))
            ties += tl.sum(eq)
        i = tl.arange(0, BLOCK_K)
        tl.store(out_row + i, tl.full([BLOCK_K], -1, tl.int32), mask=(i >= kk) & (i < out_width))


ROW_MAX = 65536  # the widest row one program of _select_kernel holds (a power of two)


def select_topk(
    scores: torch.Tensor,
    k: int,
    *,
    as_mask: bool = False,
    atomic: bool = True,
    num_warps: int | None = None,
    out_width: int | None = None,
    row_max: int = ROW_MAX,
) -> torch.Tensor:
    """The k best finite columns of fp32 scores [R, W] (ties → lower index): int32 [R, out_width] ascending
    with −1 padding (``select_entries``; ``out_width`` default min(k, W), at most k), or with ``as_mask`` a
    uint8 [R, W] mask. ``atomic``: compact through atomic slots + a sort of the k indices (default) instead of
    prefix sums. A row wider than ``row_max`` (what one program holds in registers) is cut into pieces of
    ``row_max`` columns, each piece's k best kept, then the k best of those (``_select_wide``)."""
    num_rows, width = scores.shape
    out_width = min(k, width) if out_width is None else out_width
    if not as_mask and not min(k, width) <= out_width <= k:
        raise ValueError(f"out_width {out_width} must lie in [min(k, W), k] = [{min(k, width)}, {k}]")
    if width > row_max:
        return _select_wide(scores, k, as_mask, atomic, out_width, row_max)
    if scores.stride(-1) != 1:
        scores = scores.contiguous()
    if as_mask:
        out = torch.empty(num_rows, width, dtype=torch.uint8, device=scores.device)
    else:
        out = torch.empty(num_rows, out_width, dtype=torch.int32, device=scores.device)
    if num_rows == 0 or width == 0:
        return out if as_mask else out.fill_(-1)
    block_w = triton.next_power_of_2(width)
    if num_warps is None:  # ≤ 64 keys per thread (32K: 109 registers, no spills)
        num_warps = min(16, max(4, block_w // 2048))
    counts = torch.zeros(num_rows if atomic and not as_mask else 1, dtype=torch.int32, device=scores.device)
    _select_kernel[(num_rows,)](
        scores,
        out,
        counts,
        width,
        k,
        out_width,
        scores.stride(0),
        out.stride(0),
        BLOCK_W=block_w,
        LOG_W=block_w.bit_length() - 1,
        CHUNK=min(block_w, 1024),
        BLOCK_K=triton.next_power_of_2(max(out_width, 1)),
        MASK_OUT=as_mask,
        ATOMIC=atomic,
        num_warps=num_warps,
    )
    return out


def _select_wide(
    scores: torch.Tensor, k: int, as_mask: bool, atomic: bool, out_width: int, row_max: int
) -> torch.Tensor:
    """``select_topk`` of rows wider than ``row_max``, exactly: each piece of ``row_max`` columns keeps its
    k best (ties → lower index, as the whole row would), and the k best of the pieces' picks,
    laid out piece by piece in ascending column order, are the row's k best with the same tie order. Shapes
    depend only on [R, W] and k (no host sync: graph-capturable)."""
    num_rows, width = scores.shape
    if 2 * k > row_max:  # then the pieces' picks are fewer than the row's columns, and the recursion ends
        raise ValueError(f"select_topk of a row wider than {row_max} columns needs k ≤ {row_max // 2}, got {k}")
    num_pieces = -(-width // row_max)
    padded = scores.contiguous()
    if num_pieces * row_max != width:
        padded = torch.nn.functional.pad(padded, (0, num_pieces * row_max - width), value=-torch.inf)
    local = select_topk(padded.view(num_rows * num_pieces, row_max), k, atomic=atomic, out_width=k)
    local = local.view(num_rows, num_pieces, k)
    offsets = torch.arange(num_pieces, device=scores.device, dtype=torch.int32).mul_(row_max).view(1, -1, 1)
    columns = torch.where(local >= 0, local + offsets, -1).view(num_rows, num_pieces * k)  # ascending where ≥ 0
    picked_scores = torch.where(columns >= 0, padded.gather(1, columns.clamp(min=0).long()), -torch.inf)
    picks = select_topk(picked_scores, k, atomic=atomic, out_width=k if as_mask else out_width, row_max=row_max)
    chosen = torch.where(picks >= 0, columns.gather(1, picks.clamp(min=0).long()), -1)  # [R, out_width] ascending
    if not as_mask:
        return chosen
    mask = torch.zeros(num_rows, width + 1, dtype=torch.uint8, device=scores.device)  # column W: the −1 padding
    mask.scatter_(1, torch.where(chosen >= 0, chosen, width).long(), 1)
    return mask[:, :width].contiguous()
