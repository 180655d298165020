"""The masked MoE layout of one decode step in one launch: ``KernelMoE``'s routing metadata for the
router's top-k choices plus the shared expert, which every live row picks.

Semantics are ``reference.route_metadata`` over E + 1 stacked experts (expert E the shared one, weight
1), with ``live`` rows only: slots within an expert follow token order among the live rows, dead rows
take no slot and get ``slot_of`` 0, the capacity is T, unused slots hold 0. It also adds each routed
expert's live picks to ``counts`` (the model's expert counts). The torch version is about 20 small
launches per layer (sorts, scatters, fills, aranges): a share of a v41-s1 decode step's small torch
launches at batch 1 (docs/performance.md, "Decode step", the step profile).

One program: integer counting, no sort. Token tiles of BLOCK_T rows are taken in order; in a tile, the
membership matrix m [BLOCK_T, E_PAD] (row t picked expert e) gives each pick's slot as the exclusive
cumulative sum of m down the tile plus the counts carried from earlier tiles. Exact integer work and
copies: the same bytes as the reference. Meant for decode sizes (``MAX_TOKENS``); bigger steps use the
torch version.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_TOKENS = 1024
"""Above this the tiles' serial walk (one program) costs more than the torch version's launches."""


@triton.jit
def _layout(
    experts_ptr,
    weights_ptr,
    live_ptr,
    counts_ptr,
    row_ids_ptr,
    route_w_ptr,
    slot_of_ptr,
    active_ptr,
    num_active_ptr,
    expert_counts_ptr,
    num_tokens,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
    LIVE: tl.constexpr,
    COUNT: tl.constexpr,
):
    """experts int [T, TOP_K], weights fp32 [T, TOP_K], live bool [T] (LIVE); outputs for E + 1 stacked
    experts: counts int32 [E+1], row_ids int32 / route_w fp32 [E+1, T], slot_of int64 [T, TOP_K+1],
    active int32 [E+1], num_active int32 [1]; COUNT: expert_counts int64 [E] += routed live picks.
    The whole layout in the calling program (``_layout_kernel``'s one, or the router's: kernels/moe_router.py)."""
    STACKED: tl.constexpr = NUM_EXPERTS + 1
    SHARED: tl.constexpr = NUM_EXPERTS
    # Unused slots are 0 in the reference: clear the grid, then (after the barrier) write the picks.
    total = STACKED * num_tokens
    start = 0
    while start < total:
        offs = start + tl.arange(0, BLOCK_FILL)
        tl.store(row_ids_ptr + offs, tl.zeros([BLOCK_FILL], tl.int32), mask=offs < total)
        tl.store(route_w_ptr + offs, tl.zeros([BLOCK_FILL], tl.float32), mask=offs < total)
        start += BLOCK_FILL
    tl.debug_barrier()
    cols = tl.arange(0, E_PAD)  # [E_PAD]
    j = tl.arange(0, K_PAD)  # [K_PAD]
    carry = tl.zeros([E_PAD], tl.int32)
    t0 = 0
    while t0 < num_tokens:
        t = t0 + tl.arange(0, BLOCK_T)  # [BT]
        ok = t < num_tokens
        if LIVE:
            ok = ok & (tl.load(live_ptr + t, mask=t < num_tokens, other=0) != 0)
        pick_ok = ok[:, None] & (j[None, :] < TOP_K)  # [BT, K_PAD]
        e = tl.load(experts_ptr + t[:, None] * TOP_K + j[None, :], mask=pick_ok, other=-1).to(tl.int32)
        w = tl.load(weights_ptr + t[:, None] * TOP_K + j[None, :], mask=pick_ok, other=0.0)
        hit = (e[:, :, None] == cols[None, None, :]).to(tl.int32)  # [BT, K_PAD, E_PAD]
        m = tl.sum(hit, axis=1) + ((cols[None, :] == SHARED) & ok[:, None]).to(tl.int32)  # [BT, E_PAD]
        before = tl.cumsum(m, axis=0) - m + carry[None, :]  # slot of row t in expert e, where m = 1
        slot = tl.sum(hit * before[:, None, :], axis=2)  # [BT, K_PAD]
        flat = e * num_tokens + slot
        tl.store(row_ids_ptr + flat, t[:, None] + 0 * j[None, :], mask=pick_ok)
        tl.store(route_w_ptr + flat, w, mask=pick_ok)
        tl.store(
            slot_of_ptr + t[:, None] * (TOP_K + 1) + j[None, :],
            tl.where(pick_ok, flat, 0).to(tl.int64),
            mask=(t[:, None] < num_tokens) & (j[None, :] < TOP_K),
        )
        shared_slot = tl.sum(tl.where(cols[None, :] == SHARED, before, 0), axis=1)  # [BT]
        shared_flat = SHARED * num_tokens + shared_slot
        tl.store(row_ids_ptr + shared_flat, t, mask=ok)
        tl.store(route_w_ptr + shared_flat, tl.full([BLOCK_T], 1.0, tl.float32), mask=ok)
        tl.store(slot_of_ptr + t * (TOP_K + 1) + TOP_K, tl.where(ok, shared_flat, 0).to(tl.int64), mask=t < num_tokens)
        carry += tl.sum(m, axis=0)
        t0 += BLOCK_T
    stacked = cols < STACKED
    tl.store(counts_ptr + cols, carry, mask=stacked)
    busy = (carry > 0) & stacked
    idle = (carry == 0) & stacked
    num_busy = tl.sum(busy.to(tl.int32), axis=0)
    busy_rank = tl.cumsum(busy.to(tl.int32), axis=0) - busy.to(tl.int32)
    idle_rank = num_busy + tl.cumsum(idle.to(tl.int32), axis=0) - idle.to(tl.int32)
    tl.store(active_ptr + tl.where(busy, busy_rank, idle_rank), cols, mask=stacked)
    tl.store(num_active_ptr + tl.arange(0, 1), tl.full([1], 0, tl.int32) + num_busy)
    if COUNT:
        routed = cols < NUM_EXPERTS
        old = tl.load(expert_counts_ptr + cols, mask=routed, other=0)
        tl.store(expert_counts_ptr + cols, old + carry.to(tl.int64), mask=routed)


@triton.jit(do_not_specialize=("num_tokens",))
def _layout_kernel(
    experts_ptr,
    weights_ptr,
    live_ptr,
    counts_ptr,
    row_ids_ptr,
    route_w_ptr,
    slot_of_ptr,
    active_ptr,
    num_active_ptr,
    expert_counts_ptr,
    num_tokens,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_FILL: tl.constexpr,
    LIVE: tl.constexpr,
    COUNT: tl.constexpr,
):
    _layout(
        experts_ptr,
        weights_ptr,
        live_ptr,
        counts_ptr,
        row_ids_ptr,
        route_w_ptr,
        slot_of_ptr,
        active_ptr,
        num_active_ptr,
        expert_counts_ptr,
        num_tokens,
        NUM_EXPERTS,
        TOP_K,
        K_PAD,
        E_PAD,
        BLOCK_T,
        BLOCK_FILL,
        LIVE,
        COUNT,
    )


def layout_outputs(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``moe_layout``'s unwritten outputs (``route_metadata``'s keys) over num_experts + 1 stacked experts."""
    stacked = num_experts + 1
    return {
        "counts": torch.empty(stacked, dtype=torch.int32, device=device),
        "row_ids": torch.empty(stacked, num_tokens, dtype=torch.int32, device=device),
        "route_w": torch.empty(stacked, num_tokens, dtype=torch.float32, device=device),
        "slot_of": torch.empty(num_tokens, top_k + 1, dtype=torch.int64, device=device),
        "active": torch.empty(stacked, dtype=torch.int32, device=device),
        "num_active": torch.empty(1, dtype=torch.int32, device=device),
    }


def layout_block_t(top_k: int, num_experts: int) -> int:
    """Rows per tile of the layout's walk: [BLOCK_T, K_PAD, E_PAD] ≤ 8K, 64 per thread at 4 warps."""
    k_pad, e_pad = triton.next_power_of_2(top_k), triton.next_power_of_2(num_experts + 1)
    return max(1, min(16, 8192 // (k_pad * e_pad)))


def moe_layout(
    experts: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    live: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """``route_metadata`` of the router's choices (experts int [T, k] distinct per row, weights fp32
    [T, k]) with the shared expert ``num_experts`` appended to every live row (weight 1), over
    num_experts + 1 stacked experts; rows outside ``live`` (bool [T]; None: all) take no slot.
    ``expert_counts`` int64 [num_experts], when given, gains each routed expert's live picks."""
    num_tokens, top_k = experts.shape
    if weights.shape != experts.shape:
        raise ValueError(f"weights {tuple(weights.shape)} and experts {tuple(experts.shape)} differ")
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"{num_tokens} tokens: moe_layout is for decode steps of at most {MAX_TOKENS}")
    out = layout_outputs(num_tokens, top_k, num_experts, experts.device)
    k_pad, e_pad = triton.next_power_of_2(top_k), triton.next_power_of_2(num_experts + 1)
    block_t = layout_block_t(top_k, num_experts)
    _layout_kernel[(1,)](
        experts.contiguous(),
        weights.float().contiguous(),
        live.contiguous() if live is not None else out["counts"],  # bool: loaded as i1, no conversion launch
        out["counts"],
        out["row_ids"],
        out["route_w"],
        out["slot_of"],
        out["active"],
        out["num_active"],
        expert_counts if expert_counts is not None else out["counts"],
        num_tokens,
        NUM_EXPERTS=num_experts,
        TOP_K=top_k,
        K_PAD=k_pad,
        E_PAD=e_pad,
        BLOCK_T=block_t,
        BLOCK_FILL=1024,
        LIVE=live is not None,
        COUNT=expert_counts is not None,
        num_warps=4,
    )
    return out
