"""Applying an EPLB layout: every rank moves the expert weights its new slots need, over the moves group.

Every rank holds the old and the new layout of each layer, so all compute the same plan without talking:
new slot ``k`` of rank ``d`` holds logical expert ``e``; it is filled from ``d``'s own old slots when ``d``
already holds ``e``, else from the lowest rank that does (a peer copy). The copies of one layer are one
``all_to_all_single`` on the moves group, each expert's tensors (the torch MoE's ``w1 | w3 | w2``; the kernel
layer's FP8 codes and fp32 block scales, or its MXFP4 codes and e8m0 scale bytes) flattened into one row of
bytes, in (destination, slot) order on the sender, so the receiver knows where each row goes. The call is
collective: every rank applies the same layouts at the same step boundary (between steps), and the new
layout takes effect for the next step on all of them.

A layer hands out its slots' weights (``expert_weights``) and takes the moved ones (``put_expert_weights``):
the torch MoE swaps its parameters; the kernel layer copies the changed slots into its stacks in place, so a
CUDA graph captured on them stays valid (services/worker/parallel/ep_kernel_moe.py).
"""

from __future__ import annotations

import torch

from model.deepseek_v41.model import DeepseekV41
from services.eplb.layout import Layout
from services.worker.parallel.ep_kernel_moe import ExpertParallelKernelMoE
from services.worker.parallel.ep_moe import ExpertParallel, ExpertParallelMoE
from services.worker.parallel.exchange import all_to_all_rows
from services.worker.parallel.expert_slots import ExpertSlots


def move_plan(old: Layout, new: Layout) -> list[list[int]]:
    """``[rank][new slot]`` → the rank whose old slots provide that slot's expert."""
    if (old.num_gpus, old.num_logical) != (new.num_gpus, new.num_logical):
        raise ValueError(
            f"a layout over {new.num_gpus} ranks and {new.num_logical} experts cannot replace one over "
            f"{old.num_gpus} ranks and {old.num_logical} experts"
        )
    holders = [sorted({slot // old.slots_per_gpu for slot in slots}) for slots in old.log2phy()]
    plan = []
    for d in range(new.num_gpus):
        experts = new.phy2log[d * new.slots_per_gpu : (d + 1) * new.slots_per_gpu]
        plan.append([d if d in holders[e] else holders[e][0] for e in experts])
    return plan


def changed_slots(old: Layout, new: Layout, rank: int) -> list[int]:
    """Rank ``rank``'s new slots whose expert differs from its old one (the only ones a move writes); every new
    slot when the number of slots changes."""
    s = new.slots_per_gpu
    if old.slots_per_gpu != s:
        return list(range(s))
    mine = slice(rank * s, (rank + 1) * s)
    return [k for k, (a, b) in enumerate(zip(old.phy2log[mine], new.phy2log[mine], strict=True)) if a != b]


def apply_layouts(
    model: DeepseekV41, parallel: ExpertParallel, layouts: list[Layout], group: torch.distributed.ProcessGroup
) -> int:
    """Moves this rank's expert weights to ``layouts`` (one per layer) and switches the gate to them.
    Returns the number of experts this rank received from peers. The torch MoE takes layouts of any number of
    slots; the kernel layer only its own number (its stacks keep their shape and addresses: CUDA graphs read
    them), refused before anything moves."""
    if len(layouts) != len(parallel.slots):
        raise ValueError(f"{len(layouts)} layouts for {len(parallel.slots)} layers")
    ffns = [model.layers[layer].ffn for layer in range(len(layouts))]
    for layer, (ffn, new) in enumerate(zip(ffns, layouts)):
        if not isinstance(ffn, ExpertParallelMoE | ExpertParallelKernelMoE):
            raise ValueError(f"layer {layer} is not expert-parallel")
        here = parallel.slots[layer].layout
        if isinstance(ffn, ExpertParallelKernelMoE) and new.num_slots != here.num_slots:
            raise ValueError(
                f"layer {layer}'s layout has {new.num_slots} expert slots; the kernel layer keeps its "
                f"{here.num_slots} (CUDA graphs read its stacks)"
            )
    received = 0
    for layer, (ffn, new) in enumerate(zip(ffns, layouts)):
        slots = parallel.slots[layer]
        changed = changed_slots(slots.layout, new, slots.rank)
        only = changed if ffn.moves_in_place else None
        weights, num_received = moved_weights(slots.layout, slots.rank, ffn.expert_weights(), new, group, only)
        ffn.put_expert_weights(weights, changed)
        if new.num_slots == slots.layout.num_slots:
            slots.assign(new)
        else:  # the torch MoE only: its slot map and counts take the new number of slots
            parallel.slots[layer] = ExpertSlots(new, slots.rank, slots.table.device)
        received += num_received
    per_rank = parallel.slots[0].slots_per_rank
    if parallel.slot_counts.shape[1:] == (per_rank,):
        parallel.slot_counts.zero_()  # they counted the old layouts' slots
    else:
        parallel.slot_counts = torch.zeros(len(layouts), per_rank, dtype=torch.long, device=parallel.slot_counts.device)
    return received


def moved_weights(
    old: Layout,
    me: int,
    weights: tuple[torch.Tensor, ...],
    new: Layout,
    group: torch.distributed.ProcessGroup,
    only: list[int] | None = None,
) -> tuple[tuple[torch.Tensor, ...], int]:
    """Rank ``me``'s expert weights under ``new``: ``weights`` = this rank's slots' tensors, each [S, ...] in
    ``old``'s slot order (any dtypes: they travel as bytes, bit for bit) → new tensors in ``new``'s slot order
    (``weights`` untouched), and the number of experts received from peers. ``only``: just these new slots'
    tensors, in this order (``changed_slots``: every peer copy lands in one). Collective on ``group``: every
    rank calls it with the same ``old`` and ``new``."""
    plan = move_plan(old, new)
    local = list(old.phy2log[me * old.slots_per_gpu : (me + 1) * old.slots_per_gpu])
    where = {e: k for k, e in reversed(list(enumerate(local)))}  # expert → an old local slot
    shapes = [w.shape[1:] for w in weights]

    def row(e: int) -> torch.Tensor:  # one expert's tensors as one row of bytes
        k = where[e]
        return torch.cat([w[k].reshape(-1).view(torch.uint8) for w in weights])

    s = new.slots_per_gpu
    send_rows, num_sent = [], []
    for d in range(new.num_gpus):  # to each peer, the experts of its new slots this rank provides, in slot order
        picks = [new.phy2log[d * s + k] for k in range(s) if d != me and plan[d][k] == me]
        send_rows += [row(e) for e in picks]
        num_sent.append(len(picks))
    num_received = [0 if r == me else sum(1 for src in plan[me] if src == r) for r in range(new.num_gpus)]
    sizes = [int(torch.Size(sh).numel()) * w.element_size() for sh, w in zip(shapes, weights)]
    send = torch.stack(send_rows) if send_rows else weights[0].new_empty((0, sum(sizes)), dtype=torch.uint8)
    got = all_to_all_rows(group, send, num_sent, num_received)
    # Received rows come by source rank, each source's in slot order.
    order = sorted((plan[me][k], k) for k in range(s) if plan[me][k] != me)
    incoming = {k: got[i] for i, (_, k) in enumerate(order)}
    wanted = list(range(s)) if only is None else only
    rows = [incoming[k] if k in incoming else row(new.phy2log[me * s + k]) for k in wanted]
    out = []
    for i in range(len(weights)):
        start = sum(sizes[:i])
        if rows:
            stacked = torch.stack([r[start : start + sizes[i]] for r in rows])  # [len(wanted), bytes]
        else:
            stacked = weights[i].new_empty((0, sizes[i]), dtype=torch.uint8)
        out.append(stacked.view(weights[i].dtype).reshape(len(rows), *shapes[i]))
    return tuple(out), len(incoming)
