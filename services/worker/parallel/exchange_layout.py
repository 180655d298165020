"""The expert-parallel kernel layer's two layouts in torch (services/worker/parallel/ep_kernel_moe.py): what
``kernels/ep_layout.py`` does in one launch each, and its specification (tests/kernels/test_ep_layout.py).

- ``send_layout``: a rank's routed picks → its peers' blocks of the send buffer (services/worker/parallel/
  peer_buffers.py): each live pick's row, slot and route weight at its place in its peer's block (its rank among
  the live picks to that peer, in pick order t·k + j), each block's count, and each pick's row in the blocks the
  outputs come back in (for the combine).
- ``received_layout``: the rows a rank received and its own tokens → the masked grouped-GEMM layout
  (``reference.route_metadata``'s keys, one choice per row) over its S local slots and the shared expert,
  stacked as expert S, its row ids naming the received rows in place in the receive buffer.

Device ops only, shapes fixed by the buffers and the pass: a CUDA graph captures them.
"""

from __future__ import annotations

import torch


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
    """Packs the live picks of x [T, D] (router's ``experts`` int [T, k], ``weights`` fp32 [T, k]; ``live`` bool
    [T], None: every row) into the send buffer's views ``rows`` [W + 1, C, D], ``meta`` int32 [W + 1, C, 2] and
    ``sent`` int64 [W + 1, 1] (block W the dump, where dead picks go). Each pick (t, j) goes to one copy of its
    expert: physical slot ``table[e, (t·k + j) mod copies[e]]`` (``ExpertSlots``' map), rank slot // S.
    ``expert_counts`` int64 [E], when given, gains every live pick. Returns int64 [T, k + 1]: each pick's row in
    the returned blocks (peer·C + place; 0 when dead), then the token's own row, W·C + t."""
    num_tokens, k = experts.shape
    world, capacity = sent.shape[0] - 1, rows.shape[1]
    flat = experts.reshape(-1).long()
    picked = (
        torch.ones(num_tokens * k, dtype=torch.bool, device=x.device)
        if live is None
        else live[:, None].expand(-1, k).reshape(-1)
    )
    if expert_counts is not None:
        expert_counts.scatter_add_(0, flat, picked.to(expert_counts.dtype))
    pair = torch.arange(flat.numel(), device=flat.device)
    physical = table[flat, pair % copies[flat]]  # [T·k]
    dest = torch.where(picked, torch.div(physical, slots_per_rank, rounding_mode="floor"), world)
    one_hot = (dest[:, None] == torch.arange(world + 1, device=x.device)).long()  # [T·k, W + 1]
    place = (torch.cumsum(one_hot, 0) - one_hot).gather(1, dest[:, None])[:, 0]  # rank among the picks to dest
    place = torch.where(picked, place, 0)  # dead picks: row 0 of the dump block (dest W)
    sent[:world].copy_(one_hot[:, :world].sum(0)[:, None])
    rows[dest, place] = x[:, None].expand(-1, k, -1).reshape(-1, x.shape[-1]).to(rows.dtype)  # pick t·k + j: row t
    pairs = torch.stack((physical % slots_per_rank, torch.zeros_like(physical)), 1).to(torch.int32)
    pairs[:, 1] = weights.reshape(-1).float().contiguous().view(torch.int32)
    meta[dest, place] = pairs
    picks = torch.where(picked, dest * capacity + place, 0).view(num_tokens, k)
    own = world * capacity + torch.arange(num_tokens, device=x.device)
    return torch.cat((picks, own[:, None]), 1)


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
    """The layout over ``num_slots`` + 1 stacked experts (the shared one last) with ``capacity`` slots each, of
    the rows ``[W·C + T]``: first the received ones (``meta`` int32 [W, C, 2]: slot and route weight bits;
    ``received`` int64 [W, 1]: rows 0 … count − 1 of each block are valid), then the rank's ``num_tokens`` own
    tokens, each picking the shared expert with weight 1 (``live`` bool [T], None: every one). ``slot_of`` [W·C +
    T, 1] follows that order; ``row_ids`` name the rows where the GEMM gathers them: received row c of block p is
    p·``block_rows`` + c (``PeerBuffers.gathered_rows``), own token t is ``own_base`` + t. ``slot_counts`` int64
    [S], when given, gains each local slot's rows. ``shared_active``: ``num_active`` counts the shared expert even
    without rows (the MXFP4 path's routed launch takes ``num_active`` − 1)."""
    world, rows_per_peer = meta.shape[:2]
    device = meta.device
    valid = (torch.arange(rows_per_peer, device=device)[None, :] < received).reshape(-1)  # [W·C]
    pairs = meta.reshape(world * rows_per_peer, 2)
    choice = torch.cat((pairs[:, 0].long(), torch.full((num_tokens,), num_slots, device=device)))
    weight = torch.cat((pairs[:, 1].contiguous().view(torch.float32), torch.ones(num_tokens, device=device)))
    own = torch.ones(num_tokens, dtype=torch.bool, device=device) if live is None else live
    layout = local_layout(choice, weight, torch.cat((valid, own)), num_slots + 1, capacity)
    gathered = (
        torch.arange(rows_per_peer, device=device)[None, :] + block_rows * torch.arange(world, device=device)[:, None]
    )
    ids = torch.cat((gathered.reshape(-1), own_base + torch.arange(num_tokens, device=device))).to(torch.int32)
    layout["row_ids"] = ids[layout["row_ids"].long()]  # unused slots: row 0 → 0, as before
    if slot_counts is not None:
        slot_counts += layout["counts"][:num_slots].long()
    if shared_active:
        layout["num_active"] = (layout["counts"][:num_slots] > 0).sum().to(torch.int32).view(1) + 1
    return layout


def local_layout(
    choice: torch.Tensor, weight: torch.Tensor, valid: torch.Tensor, num_experts: int, capacity: int
) -> dict[str, torch.Tensor]:
    """One choice per row → the masked layout (``reference.route_metadata``'s keys, k = 1: ``slot_of`` [N, 1]) over
    ``num_experts`` with ``capacity`` slots each; rows outside ``valid`` take no slot (``slot_of`` 0)."""
    num_rows = choice.shape[0]
    device = choice.device
    key = torch.where(valid, choice, num_experts)  # the sink: past every expert
    order = torch.sort(key, stable=True).indices  # rows grouped by expert, row order kept
    sorted_key = key[order]
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    starts = torch.cumsum(counts, 0) - counts
    place = torch.arange(num_rows, device=device) - starts[sorted_key]
    dump = num_experts * capacity
    flat = torch.where(sorted_key < num_experts, sorted_key * capacity + place, dump)
    row_ids = torch.zeros(dump + 1, dtype=torch.int32, device=device)
    row_ids[flat] = order.to(torch.int32)
    route_w = torch.zeros(dump + 1, dtype=torch.float32, device=device)
    route_w[flat] = weight.float()[order]
    slot_of = torch.zeros(num_rows, dtype=torch.long, device=device)
    slot_of[order] = torch.where(flat == dump, 0, flat)
    counts = counts[:num_experts]
    return {
        "counts": counts.to(torch.int32),
        "row_ids": row_ids[:dump].view(num_experts, capacity),
        "route_w": route_w[:dump].view(num_experts, capacity),
        "slot_of": slot_of[:, None],
        "active": torch.sort((counts == 0).to(torch.int32), stable=True).indices.to(torch.int32),
        "num_active": (counts > 0).sum().to(torch.int32).view(1),
    }
