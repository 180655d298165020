"""DeepInfer's two-stage greedy EPLB policy (walkthrough Pass 3 "A full EPLB run").

Stage A picks which experts get the redundant copies: one at a time, the expert whose single copy is
hottest over the window's summed load. Stage B places every copy on a GPU, minimising Σ over the
window's steps of the busiest GPU, which pairs experts whose busy steps do not overlap. The policy plans
from scratch: it never looks at the current layout.

Ties: in stage A the expert with more total load, then the lower index; in stage B the lower GPU, and
slot order among copies of equal load. Scores equal up to float noise count as ties, so summing the same
tokens in another order cannot change a plan.
"""

from __future__ import annotations

import numpy as np

from services.eplb.layout import Layout, check_load, colocation_cap, total_redundant

# Relative tolerance under which two scores are a tie (float noise from reordered sums is ~1e-15).
TIE_RTOL = 1e-9


def _first_min(scores: np.ndarray, allowed: np.ndarray | None = None) -> int:
    """Index of the lowest score (lowest index among ties), over ``allowed`` entries only."""
    masked = scores if allowed is None else np.where(allowed, scores, np.inf)
    best = masked.min()
    tol = TIE_RTOL * max(1.0, abs(float(best)))
    return int(np.flatnonzero(masked <= best + tol)[0])


def stage_a(load: np.ndarray, num_slots: int) -> list[int]:
    """Which experts get copies: the expert list in DeepInfer's slot order.

    Slots 0..N-1 hold experts 0..N-1; each further slot copies "whichever expert still has the hottest
    single copy" (walkthrough Pass 3): the largest Σ_steps load / copies. Ties go to the expert with more
    total load (so a cold expert never wins a tie against a hot one), then to the lower index. There is no
    cap on copies per expert.
    """
    load = np.asarray(load, dtype=np.float64)
    num_logical = load.shape[1]
    if num_slots < num_logical:
        raise ValueError(f"{num_slots} slots cannot hold {num_logical} experts")
    totals = load.sum(axis=0)
    copies = np.ones(num_logical, dtype=np.int64)
    order = list(range(num_logical))
    for _ in range(num_slots - num_logical):
        per_copy = totals / copies
        best = float(per_copy.max())
        tied = np.flatnonzero(per_copy >= best - TIE_RTOL * max(1.0, abs(best)))
        chosen = int(tied[np.argmax(totals[tied])])  # argmax takes the lowest index among equal totals
        copies[chosen] += 1
        order.append(chosen)
    return order


def stage_b(load: np.ndarray, slot_experts: list[int], num_gpus: int, *, spread: bool = False) -> tuple[int, ...]:
    """Where each copy goes; returns ``phy2log`` with each GPU's slots in placement order.

    Copies go heaviest first (Σ_steps of load per copy; ties keep slot order) to the non-full GPU that
    minimises Σ_steps of the busiest GPU, ties to the lower GPU. ``spread=True`` is the guarded variant:
    a GPU holding ``ceil(copies / GPUs)`` copies of an expert already is skipped while another non-full
    GPU can take it (DeepInfer itself may stack copies of one expert on one GPU).
    """
    load = np.asarray(load, dtype=np.float64)
    num_logical = load.shape[1]
    num_slots = len(slot_experts)
    if num_slots % num_gpus:
        raise ValueError(f"{num_slots} slots do not divide over {num_gpus} GPUs")
    slots_per_gpu = num_slots // num_gpus
    experts = np.asarray(slot_experts, dtype=np.int64)
    copies = np.bincount(experts, minlength=num_logical)
    copy_load = (load / np.maximum(copies, 1))[:, experts]  # [step, copy]
    order = np.argsort(-copy_load.sum(axis=0), kind="stable")
    cap = colocation_cap(copies, num_gpus)

    num_steps = load.shape[0]
    gpu_load = np.zeros((num_steps, num_gpus))
    # Per step: the busiest GPU's load, its index, and the largest load of the other GPUs. Kept in step
    # as copies land (a GPU's load only grows); ties between GPUs make ``first == second``, so the scores
    # do not depend on which of them ``arg`` names.
    first, arg, second = np.zeros(num_steps), np.zeros(num_steps, dtype=np.int64), np.zeros(num_steps)
    if num_gpus == 1:
        second[:] = -np.inf
    gpus = np.arange(num_gpus)[None, :]
    held = np.zeros((num_logical, num_gpus), dtype=np.int64)
    placed: list[list[int]] = [[] for _ in range(num_gpus)]
    filled = np.zeros(num_gpus, dtype=np.int64)
    for c in order:
        expert = int(experts[c])
        non_full = filled < slots_per_gpu
        allowed = non_full
        if spread:
            roomy = non_full & (held[expert] < cap[expert])
            allowed = roomy if roomy.any() else non_full
        # Busiest GPU per step if the copy lands on g: the max of g's new load and every other GPU.
        others = np.where(gpus == arg[:, None], second[:, None], first[:, None])
        scores = np.maximum(others, gpu_load + copy_load[:, c : c + 1]).sum(axis=0)
        g = _first_min(scores, allowed)
        gpu_load[:, g] += copy_load[:, c]
        grown = gpu_load[:, g]
        was_top = arg == g
        overtakes = ~was_top & (grown > first)
        second = np.where(overtakes, first, np.where(was_top, second, np.maximum(second, grown)))
        first = np.where(was_top | overtakes, grown, first)
        arg = np.where(overtakes, g, arg)
        held[expert, g] += 1
        filled[g] += 1
        placed[g].append(expert)
    return tuple(e for p in placed for e in p)


def deepinfer_plan(load: np.ndarray, num_gpus: int, num_slots: int, *, spread: bool = False) -> Layout:
    """Runs both stages on a ``steps × experts`` window; the layout DeepInfer would apply unchecked."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"load must be steps × experts, got shape {load.shape}")
    num_logical = load.shape[1]
    load = check_load(load, num_logical)
    phy2log = stage_b(load, stage_a(load, num_slots), num_gpus, spread=spread)
    return Layout(phy2log, num_gpus, num_logical)


def num_slots_for(num_logical: int, num_gpus: int, num_redundant: int) -> int:
    """Slots per layer after DeepInfer's rounding."""
    return num_logical + total_redundant(num_logical, num_gpus, num_redundant)
