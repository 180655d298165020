"""One MoE layer's physical expert slots on an expert-parallel group, as the gate uses them.

The layout is the EPLB planner's (services/eplb/layout.py): ``phy2log[p]`` is the logical expert held by
physical slot ``p``; rank ``r`` owns slots ``r · S … (r + 1) · S − 1`` (``S = slots_per_rank``). At start-up
it is DeepInfer's (walkthrough Pass 1 Thread 4, "How many experts each GPU holds"): the logical experts in
order, then ``num_redundant`` copies of experts 0, 1, 2, … rounded up so the slots divide by the ranks.

The gate maps each (token, top-k pick) pair to one copy of its expert: copy ``pair mod copies``, where
``pair = t · k + j`` is the pair's place in the step. Copies hold the same bytes and every expert
computes each row alone in the batch-invariant mode, so which copy serves a pair never changes a result.
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
        log2phy = layout.log2phy()
        width = max(len(s) for s in log2phy)
        # [E, width] the physical slots of each logical expert, padded with its first; [E] copies.
        self.table = torch.tensor([s + [s[0]] * (width - len(s)) for s in log2phy], dtype=torch.long, device=device)
        self.copies = torch.tensor([len(s) for s in log2phy], dtype=torch.long, device=device)

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
