"""The expert-parallel MoE layer's two layouts, one launch each: the send side (a rank's picks packed into its
peers' blocks of the send buffer, rows copied) and the receive side (the received rows and the rank's own
tokens laid out for the grouped GEMM over its local slots and the shared expert).

Semantics are ``send_layout`` and ``received_layout`` of services/worker/parallel/exchange_layout.py, the torch
version (the layer's send side and received layout were 34 and 36 small torch launches a layer, counted by
scripts/diagnostics/count_ep_ops.py: sorts, one-hot cumulative sums, scatters, cats), with the same bytes in
everything a reader reads: the blocks sent to peers up to their counts, the returned picks, the layout, the
counts. Dead picks write nothing (the torch version puts them in the dump block, which is never sent nor read).

Send (``send_layout``): a grid of (token tile, column chunk) programs. Each program walks the tokens before its tile
(in wider steps) and counts their live picks per destination rank (integer work, so every program gets the same
counts), then gives its tile's picks their places: the exclusive cumulative sum, in pick order t·k + j, of the
picks' one-hot destinations, plus the earlier tiles' counts. It copies its column chunk of each live pick's row; the
first chunk's program also writes the picks' (slot, weight bits), the returned picks and the expert counts (integer
atomics: order-free), and the last tile's the per-peer counts.

Receive (``received_layout``): one program walking tiles of rows in order, as kernels/moe_layout.py does: in a
tile the membership matrix m [BLOCK_R, E_PAD] (row r takes stacked expert e) gives each row's slot as the
exclusive cumulative sum of m down the tile plus the counts carried from earlier tiles. Row ids name each row
where the GEMM gathers it (received rows in place in the receive buffer, own tokens from ``own_base``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _destinations(
    experts_ptr,
    live_ptr,
    table_ptr,
    copies_ptr,
    t,
    j,
    num_tokens,
    table_width,
    slots_per_rank,
    TOP_K: tl.constexpr,
    LIVE: tl.constexpr,
):
    """The picks (t [BT], j [K_PAD]) of a tile: (expert, physical slot's rank, slot on that rank, live) [BT, K_PAD]."""
    ok = (t[:, None] < num_tokens) & (j[None, :] < TOP_K)
    if LIVE:
        ok = ok & (tl.load(live_ptr + t, mask=t < num_tokens, other=0) != 0)[:, None]
    pair = t[:, None] * TOP_K + j[None, :]
    e = tl.load(experts_ptr + pair, mask=ok, other=0).to(tl.int64)
    copy = pair.to(tl.int64) % tl.load(copies_ptr + e, mask=ok, other=1)
    physical = tl.load(table_ptr + e * table_width + copy, mask=ok, other=0)
    return e, physical // slots_per_rank, physical % slots_per_rank, ok


@triton.jit(do_not_specialize=("num_tokens",))
def _send_kernel(
    x_ptr,
    experts_ptr,
    weights_ptr,
    live_ptr,
    table_ptr,
    copies_ptr,
    rows_ptr,
    meta_ptr,
    sent_ptr,
    picks_ptr,
    expert_counts_ptr,
    num_tokens,
    hidden,
    x_stride,
    rows_stride,
    meta_stride,
    sent_stride,
    table_width,
    slots_per_rank,
    capacity,
    world,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    SCAN_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHUNK_D: tl.constexpr,
    LIVE: tl.constexpr,
    COUNT: tl.constexpr,
):
    tile, chunk = tl.program_id(0), tl.program_id(1)
    j = tl.arange(0, K_PAD)
    ranks = tl.arange(0, W_PAD)
    carry = tl.zeros([W_PAD], tl.int32)
    start = tile * BLOCK_T
    t0 = 0
    while t0 < start:  # the earlier tokens' live picks per destination, SCAN_T tokens at a time
        t = t0 + tl.arange(0, SCAN_T)
        _, dest, _, ok = _destinations(
            experts_ptr, live_ptr, table_ptr, copies_ptr, t, j, start, table_width, slots_per_rank, TOP_K, LIVE
        )
        hit = ((dest[:, :, None] == ranks[None, None, :]) & ok[:, :, None]).to(tl.int32)  # [BT, K_PAD, W_PAD]
        carry += tl.sum(tl.sum(hit, axis=1), axis=0)
        t0 += SCAN_T
    t = start + tl.arange(0, BLOCK_T)
    e, dest, slot, ok = _destinations(
        experts_ptr, live_ptr, table_ptr, copies_ptr, t, j, num_tokens, table_width, slots_per_rank, TOP_K, LIVE
    )
    hit = ((dest[:, :, None] == ranks[None, None, :]) & ok[:, :, None]).to(tl.int32)
    flat_hit = tl.reshape(hit, [BLOCK_T * K_PAD, W_PAD])  # pick order t·k + j (padded j never live)
    before = tl.cumsum(flat_hit, axis=0) - flat_hit + carry[None, :]
    place = tl.reshape(tl.sum(before * flat_hit, axis=1), [BLOCK_T, K_PAD]).to(tl.int64)
    # This chunk of the live picks' rows.
    target = dest * rows_stride + place * hidden  # [BT, K_PAD] elements from the rows' start
    d0 = chunk * CHUNK_D
    for dd in range(0, CHUNK_D, BLOCK_D):
        d = d0 + dd + tl.arange(0, BLOCK_D)
        in_row = d < hidden
        v = tl.load(x_ptr + t[:, None].to(tl.int64) * x_stride + d[None, :], mask=(t[:, None] < num_tokens) & in_row)
        tl.store(
            rows_ptr + target[:, :, None] + d[None, None, :],
            tl.broadcast_to(v[:, None, :], [BLOCK_T, K_PAD, BLOCK_D]).to(rows_ptr.dtype.element_ty),
            mask=ok[:, :, None] & in_row[None, None, :],
        )
    if chunk == 0:
        pick = t[:, None] * TOP_K + j[None, :]
        w = tl.load(weights_ptr + pick, mask=ok, other=0.0).to(tl.float32)
        at = meta_ptr + dest * meta_stride + place * 2
        tl.store(at, slot.to(tl.int32), mask=ok)
        tl.store(at + 1, w.to(tl.int32, bitcast=True), mask=ok)
        tl.store(
            picks_ptr + t[:, None] * (TOP_K + 1) + j[None, :],
            tl.where(ok, dest * capacity + place, 0),
            mask=(t[:, None] < num_tokens) & (j[None, :] < TOP_K),
        )
        own = world * capacity + t.to(tl.int64)
        tl.store(picks_ptr + t * (TOP_K + 1) + TOP_K, own, mask=t < num_tokens)
        if COUNT:
            tl.atomic_add(expert_counts_ptr + e, tl.full([BLOCK_T, K_PAD], 1, tl.int64), mask=ok)
        if tile == tl.num_programs(0) - 1:
            total = carry + tl.sum(tl.sum(hit, axis=1), axis=0)
            tl.store(sent_ptr + ranks * sent_stride, total.to(tl.int64), mask=ranks < world)


SEND_BLOCK_T = 8
"""Tokens per program of the send side: each program recounts the tokens before its own (small integer work)."""
SEND_SCAN_T = 128
SEND_SCAN_ELEMENTS = 8192
"""The recount walks up to SEND_SCAN_T tokens a step ([SCAN_T, K_PAD, W_PAD] ≤ SEND_SCAN_ELEMENTS): a decode step's
few hundred tokens in one or two steps, each a chain of dependent loads (expert, its copies, its slot)."""
SEND_CHUNK_D = 512
"""Columns of the rows each send program copies (a second grid dimension, so the copy spreads over the GPU)."""


def send_layout(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    live: torch.Tensor | None,
    table: torch.Tensor,
    copies: torch.Tensor,
    slots_per_rank: int,
    rows: torch.Tensor,
    meta: torch.Tensor,
    sent: torch.Tensor,
    expert_counts: torch.Tensor | None = None,
) -> torch.Tensor:
    """As services/worker/parallel/exchange_layout.py ``send_layout`` (the same arguments and result), in one
    launch. ``rows``, ``meta`` and ``sent`` are views of one send buffer (``PeerBuffers``'), dense past their
    first dimension."""
    num_tokens, top_k = experts.shape
    hidden = x.shape[-1]
    world, capacity = sent.shape[0] - 1, rows.shape[1]
    if x.stride(-1) != 1 or rows.stride()[1:] != (hidden, 1) or meta.stride()[1:] != (2, 1):
        raise ValueError("send_layout: x's rows, and the buffers past their first dimension, must be dense")
    picks = torch.empty(num_tokens, top_k + 1, dtype=torch.int64, device=x.device)
    if num_tokens == 0:
        return picks
    chunk_d = min(SEND_CHUNK_D, triton.next_power_of_2(hidden))
    k_pad, w_pad = triton.next_power_of_2(top_k), triton.next_power_of_2(world + 1)
    grid = (triton.cdiv(num_tokens, SEND_BLOCK_T), triton.cdiv(hidden, chunk_d))
    _send_kernel[grid](
        x,
        experts.contiguous(),
        weights.contiguous(),
        live.contiguous() if live is not None else picks,  # bool: loaded as i1, no conversion launch
        table,
        copies,
        rows,
        meta,
        sent,
        picks,
        expert_counts if expert_counts is not None else picks,
        num_tokens,
        hidden,
        x.stride(0),
        rows.stride(0),
        meta.stride(0),
        sent.stride(0),
        table.stride(0),
        slots_per_rank,
        capacity,
        world,
        TOP_K=top_k,
        K_PAD=k_pad,
        W_PAD=w_pad,
        BLOCK_T=SEND_BLOCK_T,
        SCAN_T=max(SEND_BLOCK_T, min(SEND_SCAN_T, SEND_SCAN_ELEMENTS // (k_pad * w_pad))),
        BLOCK_D=min(128, chunk_d),
        CHUNK_D=chunk_d,
        LIVE=live is not None,
        COUNT=expert_counts is not None,
        num_warps=4,
    )
    return picks


@triton.jit(do_not_specialize=("num_tokens",))
def _received_kernel(
    meta_ptr,
    received_ptr,
    live_ptr,
    counts_ptr,
    row_ids_ptr,
    route_w_ptr,
    slot_of_ptr,
    active_ptr,
    num_active_ptr,
    slot_counts_ptr,
    num_tokens,
    rows_per_peer,
    meta_stride,
    received_stride,
    capacity,
    world,
    block_rows,
    own_base,
    NUM_SLOTS: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
    LIVE: tl.constexpr,
    COUNT: tl.constexpr,
    SHARED_ACTIVE: tl.constexpr,
):
    STACKED: tl.constexpr = NUM_SLOTS + 1
    total = STACKED * capacity  # unused slots are 0 in the torch version: clear, then (after the barrier) write
    start = 0
    while start < total:
        offs = start + tl.arange(0, BLOCK_FILL)
        tl.store(row_ids_ptr + offs, tl.zeros([BLOCK_FILL], tl.int32), mask=offs < total)
        tl.store(route_w_ptr + offs, tl.zeros([BLOCK_FILL], tl.float32), mask=offs < total)
        start += BLOCK_FILL
    tl.debug_barrier()
    cols = tl.arange(0, E_PAD)
    carry = tl.zeros([E_PAD], tl.int32)
    received_rows = world * rows_per_peer
    num_rows = received_rows + num_tokens
    r0 = 0
    while r0 < num_rows:
        r = r0 + tl.arange(0, BLOCK_R)
        peer, c = r // rows_per_peer, r % rows_per_peer
        is_received = r < received_rows
        got = tl.load(received_ptr + peer.to(tl.int64) * received_stride, mask=is_received, other=0)
        at = meta_ptr + peer.to(tl.int64) * meta_stride + c * 2
        slot = tl.load(at, mask=is_received, other=0)
        w = tl.load(at + 1, mask=is_received, other=0).to(tl.float32, bitcast=True)
        own = r - received_rows
        own_ok = (r >= received_rows) & (r < num_rows)
        if LIVE:
            own_ok = own_ok & (tl.load(live_ptr + own, mask=own_ok, other=0) != 0)
        valid = (is_received & (c < got)) | own_ok
        choice = tl.where(is_received, slot, NUM_SLOTS)
        weight = tl.where(is_received, w, 1.0)
        m = ((choice[:, None] == cols[None, :]) & valid[:, None]).to(tl.int32)  # [BR, E_PAD]
        before = tl.cumsum(m, axis=0) - m + carry[None, :]
        place = tl.sum(m * before, axis=1)  # [BR]
        flat = choice * capacity + place
        tl.store(row_ids_ptr + flat, tl.where(is_received, peer * block_rows + c, own_base + own), mask=valid)
        tl.store(route_w_ptr + flat, weight, mask=valid)
        tl.store(slot_of_ptr + r, tl.where(valid, flat, 0).to(tl.int64), mask=r < num_rows)
        carry += tl.sum(m, axis=0)
        r0 += BLOCK_R
    stacked = cols < STACKED
    tl.store(counts_ptr + cols, carry, mask=stacked)
    busy = (carry > 0) & stacked
    idle = (carry == 0) & stacked
    num_busy = tl.sum(busy.to(tl.int32), axis=0)
    busy_rank = tl.cumsum(busy.to(tl.int32), axis=0) - busy.to(tl.int32)
    idle_rank = num_busy + tl.cumsum(idle.to(tl.int32), axis=0) - idle.to(tl.int32)
    tl.store(active_ptr + tl.where(busy, busy_rank, idle_rank), cols, mask=stacked)
    if SHARED_ACTIVE:
        num_busy = tl.sum((busy & (cols < NUM_SLOTS)).to(tl.int32), axis=0) + 1
    tl.store(num_active_ptr + tl.arange(0, 1), tl.full([1], 0, tl.int32) + num_busy)
    if COUNT:
        local = cols < NUM_SLOTS
        old = tl.load(slot_counts_ptr + cols, mask=local, other=0)
        tl.store(slot_counts_ptr + cols, old + carry.to(tl.int64), mask=local)


RECEIVED_ELEMENTS = 16384
"""The receive side's tile [BLOCK_R, E_PAD] (at most 256 rows): 64 values a thread at 8 warps (v41-s1's 49 stacked
experts: 256 rows a step, a batch-64 decode step's 448 rows in two; 128 registers, no spills for sm_90a)."""


def received_layout(
    meta: torch.Tensor,
    received: torch.Tensor,
    live: torch.Tensor | None,
    num_tokens: int,
    num_slots: int,
    capacity: int,
    block_rows: int,
    own_base: int,
    slot_counts: torch.Tensor | None = None,
    shared_active: bool = False,
) -> dict[str, torch.Tensor]:
    """As services/worker/parallel/exchange_layout.py ``received_layout`` (the same arguments and result), in one
    launch. ``meta`` [W, C, 2] and ``received`` [W, 1] are views of one receive buffer, dense past their first
    dimension."""
    world, rows_per_peer = meta.shape[:2]
    if meta.stride()[1:] != (2, 1):
        raise ValueError("received_layout: meta must be dense past its first dimension")
    device = meta.device
    stacked = num_slots + 1
    num_rows = world * rows_per_peer + num_tokens
    out = {
        "counts": torch.empty(stacked, dtype=torch.int32, device=device),
        "row_ids": torch.empty(stacked, capacity, dtype=torch.int32, device=device),
        "route_w": torch.empty(stacked, capacity, dtype=torch.float32, device=device),
        "slot_of": torch.empty(num_rows, 1, dtype=torch.int64, device=device),
        "active": torch.empty(stacked, dtype=torch.int32, device=device),
        "num_active": torch.empty(1, dtype=torch.int32, device=device),
    }
    e_pad = triton.next_power_of_2(stacked)
    _received_kernel[(1,)](
        meta,
        received,
        live.contiguous() if live is not None else out["counts"],
        out["counts"],
        out["row_ids"],
        out["route_w"],
        out["slot_of"],
        out["active"],
        out["num_active"],
        slot_counts if slot_counts is not None else out["counts"],
        num_tokens,
        rows_per_peer,
        meta.stride(0),
        received.stride(0),
        capacity,
        world,
        block_rows,
        own_base,
        NUM_SLOTS=num_slots,
        E_PAD=e_pad,
        BLOCK_R=max(1, min(256, RECEIVED_ELEMENTS // e_pad)),
        BLOCK_FILL=1024,
        LIVE=live is not None,
        COUNT=slot_counts is not None,
        SHARED_ACTIVE=shared_active,
        num_warps=8,
    )
    return out
