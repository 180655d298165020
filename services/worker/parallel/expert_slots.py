"""One MoE layer's physical expert slots on an expert-parallel group, as the gate uses them.

The layout is the EPLB planner's (services/eplb/layout.py): ``phy2log[p]`` is the logical expert held by
physical slot ``p``; rank ``r`` owns slots ``r · S … (r + 1) · S − 1`` (``S = slots_per_rank``). At start-up
it is DeepInfer's (walkthrough Pass 1 Thread 4, "How many experts each GPU holds"): the logical experts in
order, then ``num_redundant`` copies of experts 0, 1, 2, … rounded up so the slots divide by the ranks.

The gate maps each (token, top-k pick) pair to one copy of its expert: copy ``pair mod copies``, where
``pair = t · k + j`` is the pair's place in the step. Copies hold the same bytes and every expert
computes each row alone in the batch-invariant mode, so which copy serves a pair never changes a result.

The slot map's tensors (``table``, ``copies``) are made once, at a width every layout of the same shape fits
(an expert has at most ``num_slots − num_logical + 1`` copies), and a new layout is written into them in place
(``assign``): a CUDA graph captured on them routes by the new layout at its next replay.
"""

from __future__ import annotations

import torch

from services.eplb.layout import Layout, startup_layout


class ExpertSlots:
    def __init__(self, layout: Layout, rank: int, device: torch.device | str = "cpu") -> None:
        if not 0 <= rank < layout.num_gpus:
            raise ValueError(f"rank {rank} is outside a layout over {layout.num_gpus} ranks")
        self.layout = layout
        self.rank = rank
        self.slots_per_rank = layout.slots_per_gpu
        # [E, width] the physical slots of each logical expert, padded with its first; [E] copies.
        self.table, self.copies = _maps(layout, layout.num_slots - layout.num_logical + 1, device)

    def assign(self, layout: Layout) -> None:
        """Writes ``layout`` (the same ranks, slots and experts) into this map's tensors in place."""
        here = self.layout
        if (layout.num_gpus, layout.num_slots, layout.num_logical) != (here.num_gpus, here.num_slots, here.num_logical):
            raise ValueError(
                f"a layout of {layout.num_slots} slots over {layout.num_gpus} ranks and {layout.num_logical} experts "
                f"cannot replace one of {here.num_slots} over {here.num_gpus} and {here.num_logical}"
            )
        table, copies = _maps(layout, self.table.shape[1], "cpu")
        self.table.copy_(staged(table, self.table.device), non_blocking=True)
        self.copies.copy_(staged(copies, self.table.device), non_blocking=True)
        self.layout = layout

    @staticmethod
    def startup(
        num_logical: int, world_size: int, num_redundant: int, rank: int, device: torch.device | str = "cpu"
    ) -> "ExpertSlots":
        return ExpertSlots(startup_layout(num_logical, world_size, num_redundant), rank, device)

    @property
    def local_experts(self) -> list[int]:
        """The logical expert in each of this rank's slots, in slot order."""
        s = self.slots_per_rank
        return list(self.layout.phy2log[self.rank * s : (self.rank + 1) * s])

    def physical(self, experts: torch.Tensor) -> torch.Tensor:
        """Logical expert ids [T, k] → physical slots [T · k], one copy per pair (module docstring)."""
        flat = experts.reshape(-1)
        pair = torch.arange(flat.numel(), device=flat.device)
        return self.table[flat, pair % self.copies[flat]]


def _maps(layout: Layout, width: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """``layout``'s [E, width] slot table (each expert's slots, padded with its first) and [E] copies."""
    log2phy = layout.log2phy()
    table = torch.tensor([s + [s[0]] * (width - len(s)) for s in log2phy], dtype=torch.long, device=device)
    return table, torch.tensor([len(s) for s in log2phy], dtype=torch.long, device=device)


def staged(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor ready for a ``non_blocking`` copy to ``device``: pinned for a GPU, so the copy is queued on
    the current stream behind the step in flight rather than waiting for it."""
    return t.pin_memory() if device.type == "cuda" else t
