"""Physical expert slots: DeepInfer's rounding and start-up layout, and one copy per (token, pick) pair."""

from __future__ import annotations

import torch

from services.worker.parallel.expert_slots import ExpertSlots


def test_walkthrough_rounding_and_startup_copies():
    # Pass 1 Thread 4: 384 experts + 32 copies over EP8 = 416 slots, 52 per GPU, copies of experts 0-31.
    slots = ExpertSlots.startup(384, 8, 32, rank=7)
    assert slots.slots_per_rank == 52
    assert slots.local_experts == list(range(364, 384)) + list(range(32))
    # 8 experts, ≥ 2 copies over 4 ranks: 10 rounded up to 12 slots, copies of experts 0-3 on rank 3.
    tiny = ExpertSlots.startup(8, 4, 2, rank=3)
    assert (tiny.slots_per_rank, tiny.local_experts) == (3, [1, 2, 3])
    assert ExpertSlots.startup(8, 4, 2, rank=2).local_experts == [6, 7, 0]


def test_pairs_take_copies_in_turn_and_only_slots_of_their_expert():
    slots = ExpertSlots.startup(8, 4, 2, rank=0)  # expert e in slot e; copies of 0-3 in slots 8-11
    experts = torch.tensor([[0, 5], [0, 1], [3, 0]])
    physical = slots.physical(experts)
    assert physical.tolist() == [0, 5, 0, 9, 3, 8]  # pair p takes copy p mod copies
    assert all(slots.layout.phy2log[p] == e for p, e in zip(physical.tolist(), experts.flatten().tolist()))
