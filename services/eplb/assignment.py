"""Min-move slot assignment: the same placement, relabelled so that the fewest expert weights move.

moe_lb depends only on which experts share a GPU, not on which GPU index holds the group nor on the slot
order inside a GPU. So a candidate can be relabelled freely at equal quality: GPUs are matched to the
current GPUs by an assignment problem (cost = copies that would have to be loaded), and inside each GPU an
expert that is already there keeps its slot.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
from scipy.optimize import linear_sum_assignment

from services.eplb.layout import Layout, LayoutError


def _loads_needed(new: Layout, old: Layout) -> np.ndarray:
    """``[new GPU, old GPU]`` copies of the new GPU's experts that the old GPU lacks (multiset difference):
    the weights to load if the new group took the old GPU's place."""
    # loads = slots - overlap, overlap[n, o] = Σ_e min(new copies of e on n, old copies of e on o); only
    # the (GPU, expert) pairs present in the new layout contribute.
    new_counts = group_counts(new.array(), new.num_gpus, new.num_logical)
    old_counts = group_counts(old.array(), old.num_gpus, old.num_logical)
    gpu, expert = np.nonzero(new_counts)
    per_pair = np.minimum(new_counts[gpu, expert][None, :], old_counts[:, expert])  # [old gpu, pair]
    overlap = np.zeros((new.num_gpus, old.num_gpus), dtype=np.int64)
    np.add.at(overlap, gpu, per_pair.T)
    return new.slots_per_gpu - overlap


def _place_in_slots(new_group: list[int], old_group: list[int]) -> list[int]:
    """``new_group`` ordered so experts already in a slot stay there; the rest fill vacated slots."""
    remaining = Counter(new_group)
    slots: list[int | None] = [None] * len(old_group)
    for k, expert in enumerate(old_group):
        if remaining[expert] > 0:
            slots[k] = expert
            remaining[expert] -= 1
    incoming = iter(list(remaining.elements()))  # leftovers, in the candidate's first-seen order
    return [e if e is not None else next(incoming) for e in slots]


def gpu_matching(candidate: Layout, current: Layout) -> np.ndarray:
    """``[candidate GPU]`` the current GPU it should replace: the assignment with the fewest loads."""
    new_idx, old_idx = linear_sum_assignment(_loads_needed(candidate, current))
    matching = np.empty(candidate.num_gpus, dtype=np.int64)
    matching[new_idx] = old_idx
    return matching


def group_counts(phy2log: np.ndarray, num_gpus: int, num_logical: int) -> np.ndarray:
    """``[gpu, expert]`` copies of each expert on each GPU of a GPU-major ``phy2log``."""
    counts = np.zeros((num_gpus, num_logical), dtype=np.int64)
    np.add.at(counts, (np.arange(len(phy2log)) // (len(phy2log) // num_gpus), phy2log), 1)
    return counts


def moves_under(phy2log: np.ndarray, matched_counts: np.ndarray) -> int:
    """Loads needed when GPU g of ``phy2log`` replaces the GPU whose counts are ``matched_counts[g]``
    and experts already there keep their slots: the moves of that relabelling."""
    counts = group_counts(phy2log, *matched_counts.shape)
    return int(np.maximum(counts - matched_counts, 0).sum())


def min_move_relabel(candidate: Layout, current: Layout) -> Layout:
    """``candidate`` with GPUs permuted and slots reordered to minimise moves from ``current``.

    The result has the same expert groups per GPU as ``candidate`` (so the same moe_lb on any load) and
    the fewest slots whose expert changes among all such relabellings.
    """
    if (candidate.num_slots, candidate.num_gpus, candidate.num_logical) != (
        current.num_slots,
        current.num_gpus,
        current.num_logical,
    ):
        raise LayoutError("candidate and current layouts differ in slots, GPUs or experts")
    new_groups = candidate.gpu_experts()
    old_groups = current.gpu_experts()
    placed: list[list[int]] = [[] for _ in range(current.num_gpus)]
    for n, o in enumerate(gpu_matching(candidate, current)):
        placed[o] = _place_in_slots(new_groups[n], old_groups[o])
    return Layout(tuple(e for group in placed for e in group), current.num_gpus, current.num_logical)
