"""Local search over layouts: swaps of two copies between GPUs and re-targeting of a redundant copy.

Every accepted step strictly lowers Σ_steps busiest GPU (so moe_lb, whose denominator the layout cannot
change) and never adds a needless co-location (more than ceil(copies / GPUs) copies of one expert on one
GPU). ``spread_out`` first removes such co-locations, each swap lowering their number by at least one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from services.eplb.layout import Layout, colocation_cap

# Relative gain below which a step counts as float noise, not an improvement.
GAIN_RTOL = 1e-9


@dataclasses.dataclass
class _State:
    """A layout being edited, with the derived arrays kept in step with ``phy2log``."""

    load: np.ndarray  # [step, expert] tokens
    phy2log: np.ndarray  # [slot] expert
    num_gpus: int  # GPUs; slot s lives on GPU s // slots_per_gpu

    def __post_init__(self) -> None:
        self.slots_per_gpu = len(self.phy2log) // self.num_gpus
        self.gpu = np.arange(len(self.phy2log)) // self.slots_per_gpu
        self.refresh()

    def refresh(self) -> None:
        num_logical = self.load.shape[1]
        self.copies = np.bincount(self.phy2log, minlength=num_logical)
        self.held = np.zeros((num_logical, self.num_gpus), dtype=np.int64)
        np.add.at(self.held, (self.phy2log, self.gpu), 1)
        self.cap = colocation_cap(self.copies, self.num_gpus)
        self.slot_load = (self.load / self.copies)[:, self.phy2log]  # [step, slot]
        self.gpu_load = self.slot_load @ np.eye(self.num_gpus)[self.gpu]  # [step, gpu]
        self.slot_load32 = np.ascontiguousarray(self.slot_load.T, dtype=np.float32)  # [slot, step]
        self.gpu_load32 = np.ascontiguousarray(self.gpu_load.T, dtype=np.float32)  # [gpu, step]

    def score(self) -> float:
        return float(self.gpu_load.max(axis=1).sum())

    def excess(self) -> int:
        return int(np.maximum(self.held - self.cap[:, None], 0).sum())

    def slots_of(self, g: int) -> np.ndarray:
        return np.arange(g * self.slots_per_gpu, (g + 1) * self.slots_per_gpu)

    def others_max(self, g: int, h: int) -> np.ndarray:
        rest = np.delete(self.gpu_load, [g, h], axis=1)
        return rest.max(axis=1) if rest.shape[1] else np.full(self.load.shape[0], -np.inf)

    def swap_scores(self, g: int, h: int) -> np.ndarray:
        """``[i, j]`` Σ_steps busiest GPU after swapping the i-th slot of g with the j-th slot of h.

        A float32 screen (the exact score of the chosen swap is checked in float64 by ``exact_swap``).
        With d = y_j - x_i the load g gains, max(L_g + d, L_h - d) = (L_g + L_h) / 2 + |d + (L_g - L_h) / 2|.
        """
        x = self.slot_load32[self.slots_of(g)]  # [i, step]
        y = self.slot_load32[self.slots_of(h)]  # [j, step]
        lg, lh = self.gpu_load32[g], self.gpu_load32[h]
        work = y[None, :, :] - x[:, None, :]  # [i, j, step]
        work += (lg - lh) / 2
        np.abs(work, out=work)
        work += (lg + lh) / 2
        np.maximum(work, self.others_max(g, h).astype(np.float32), out=work)
        return work.sum(axis=2, dtype=np.float64)

    def exact_swap(self, g: int, i: int, h: int, j: int) -> float:
        """Σ_steps busiest GPU after that swap, in float64."""
        d = self.slot_load[:, self.slots_of(h)[j]] - self.slot_load[:, self.slots_of(g)[i]]
        gpu_load = self.gpu_load.copy()
        gpu_load[:, g] += d
        gpu_load[:, h] -= d
        return float(gpu_load.max(axis=1).sum())

    def excess_change(self, g: int, h: int) -> np.ndarray:
        """``[i, j]`` change in needless co-locations from that swap (+∞ for swapping equal experts)."""
        a = self.phy2log[self.slots_of(g)][:, None]
        b = self.phy2log[self.slots_of(h)][None, :]
        change = (
            -(self.held[a, g] > self.cap[a]).astype(np.int64)
            + (self.held[a, h] >= self.cap[a])
            - (self.held[b, h] > self.cap[b])
            + (self.held[b, g] >= self.cap[b])
        ).astype(np.float64)
        change[a == b] = np.inf
        return change

    def swap(self, g: int, i: int, h: int, j: int) -> None:
        """Swaps two slots' experts, updating the derived arrays in O(steps) (copy counts are unchanged)."""
        s, t = self.slots_of(g)[i], self.slots_of(h)[j]
        a, b = self.phy2log[s], self.phy2log[t]
        self.phy2log[s], self.phy2log[t] = b, a
        self.held[a, g] -= 1
        self.held[a, h] += 1
        self.held[b, h] -= 1
        self.held[b, g] += 1
        d = self.slot_load[:, t] - self.slot_load[:, s]  # load g gains
        self.slot_load[:, [s, t]] = self.slot_load[:, [t, s]]
        self.gpu_load[:, g] += d
        self.gpu_load[:, h] -= d
        self.slot_load32[[s, t]] = self.slot_load32[[t, s]]
        self.gpu_load32[g] = self.gpu_load[:, g]
        self.gpu_load32[h] = self.gpu_load[:, h]


def _best_swap(state: _State, g: int, h: int, *, reduce_excess: bool) -> tuple[int, int, float] | None:
    """Best swap between g and h: lowest score among swaps that cut co-locations (``reduce_excess``) or,
    otherwise, among swaps that add none and strictly lower the score."""
    scores = state.swap_scores(g, h)
    change = state.excess_change(g, h)
    allowed = change < 0 if reduce_excess else change <= 0
    scores = np.where(allowed, scores, np.inf)
    i, j = (int(k) for k in np.unravel_index(int(np.argmin(scores)), scores.shape))
    if not np.isfinite(scores[i, j]):
        return None
    exact = state.exact_swap(g, i, h, j)
    if not reduce_excess and not exact < state.score() * (1.0 - GAIN_RTOL):
        return None
    return i, j, exact


def spread_out(layout: Layout, load: np.ndarray) -> Layout:
    """Removes needless co-locations by swaps, choosing the cheapest (lowest-peak) swap each time."""
    state = _State(np.asarray(load, dtype=np.float64), layout.array().copy(), layout.num_gpus)
    while state.excess() > 0:
        crowded = np.argwhere(state.held > state.cap[:, None])
        g = int(crowded[0][1])
        options = [(h, _best_swap(state, g, h, reduce_excess=True)) for h in range(state.num_gpus) if h != g]
        h, best = min(((h, b) for h, b in options if b is not None), key=lambda hb: hb[1][2])
        state.swap(g, best[0], h, best[1])
    return Layout(tuple(state.phy2log), layout.num_gpus, layout.num_logical)


def _retarget(state: _State, num_targets: int) -> bool:
    """Re-points one redundant copy at a hotter expert if that strictly lowers the score."""
    per_copy_sum = (state.load / state.copies).sum(axis=0)
    targets = np.argsort(-per_copy_sum, kind="stable")[:num_targets]
    base = state.score()
    best: tuple[float, int, int] | None = None
    for b in targets:
        for s in np.flatnonzero(state.copies[state.phy2log] >= 2):
            a = state.phy2log[s]
            if a == b:
                continue
            trial = state.phy2log.copy()
            trial[s] = b
            copies = state.copies.copy()
            copies[a] -= 1
            copies[b] += 1
            held_b = state.held[b, state.gpu[s]] + 1
            cap = colocation_cap(copies, state.num_gpus)
            if held_b > cap[b] or (state.held[a] - (np.arange(state.num_gpus) == state.gpu[s]) > cap[a]).any():
                continue
            gpu_load = state.gpu_load.copy()
            for e, old_c, new_c in ((a, state.copies[a], copies[a]), (b, state.copies[b], copies[b])):
                old_held = state.held[e]
                new_held = np.bincount(state.gpu[trial == e], minlength=state.num_gpus)
                gpu_load += np.outer(state.load[:, e], new_held / new_c - old_held / old_c)
            score = float(gpu_load.max(axis=1).sum())
            if score < base * (1.0 - GAIN_RTOL) and (best is None or score < best[0]):
                best = (score, int(s), int(b))
    if best is None:
        return False
    state.phy2log[best[1]] = best[2]
    state.refresh()
    return True


def local_search(layout: Layout, load: np.ndarray, *, max_passes: int = 8, num_targets: int = 4) -> Layout:
    """Improves ``layout`` on ``load`` by swaps and re-targeting; each step strictly lowers the score.

    A pass tries, for each GPU that is busiest at some step and each other GPU, the best swap between them,
    then one re-targeting; it stops after a pass that changed nothing or after ``max_passes``.
    """
    state = _State(np.asarray(load, dtype=np.float64), layout.array().copy(), layout.num_gpus)
    for _ in range(max_passes):
        changed = False
        peak_counts = np.bincount(state.gpu_load.argmax(axis=1), minlength=state.num_gpus)
        for g in np.argsort(-peak_counts, kind="stable"):
            if peak_counts[g] == 0:
                break
            for h in range(state.num_gpus):
                if h == g:
                    continue
                best = _best_swap(state, int(g), h, reduce_excess=False)
                if best is not None:
                    state.swap(int(g), best[0], h, best[1])
                    changed = True
        if num_targets > 0 and _retarget(state, num_targets):
            changed = True
        if not changed:
            break
    return Layout(tuple(state.phy2log), layout.num_gpus, layout.num_logical)
