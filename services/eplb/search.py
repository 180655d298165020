"""Local search over layouts: swaps of two copies between GPUs and re-targeting of a redundant copy.

Every accepted step strictly lowers Σ_steps busiest GPU on the exact window (so moe_lb, whose denominator
the layout cannot change) and never adds a needless co-location (more than ceil(copies / GPUs) copies of
one expert on one GPU). Edits are ranked on a proxy of the window (``search_state.proxy_rows``) and the
best few are checked exactly. ``spread_out`` first removes needless co-locations, each swap lowering
their number by at least one. ``local_search_path`` returns every layout the search passed through, so
the planner can trade balance against moves.
"""

from __future__ import annotations

import numpy as np

from services.eplb.layout import Layout
from services.eplb.search_state import SearchState

# Relative gain below which a step counts as float noise, not an improvement.
GAIN_RTOL = 1e-9
# Proxy-ranked edits checked exactly per step before giving up on a GPU.
NUM_CHECKED = 4
# GPUs a busiest GPU may swap with in local search: the least loaded ones on the proxy window.
NUM_PARTNERS = 16
# Redundant copies that re-targeting may re-point: those whose experts carry the least load per copy.
NUM_SOURCES = 32


def _state(layout: Layout, load: np.ndarray) -> SearchState:
    return SearchState(np.asarray(load, dtype=np.float64), layout.array(), layout.num_gpus)


def _layout(state: SearchState, like: Layout) -> Layout:
    return Layout(tuple(int(e) for e in state.phy2log), like.num_gpus, like.num_logical)


def spread_out(layout: Layout, load: np.ndarray) -> Layout:
    """Removes needless co-locations by swaps, choosing the lowest-peak swap that cuts them each time."""
    state = _state(layout, load)
    while state.excess() > 0:
        g = int(np.argwhere(state.held > state.cap[:, None])[0][1])
        partners = np.delete(np.arange(state.num_gpus), g)
        scores = np.where(state.swap_change(g, partners) < 0, state.swap_table(g, partners), np.inf)
        k, i, j = np.unravel_index(int(np.argmin(scores)), scores.shape)
        state.swap(g, int(i), int(partners[k]), int(j))
    return _layout(state, layout)


def _improving_swap(state: SearchState, g: int, base: float) -> bool:
    """Applies the best proxy-ranked swap of g's slots (among the first ``NUM_CHECKED``) that adds no
    co-location and strictly lowers the exact score; False when none does."""
    partners = np.argsort(state.pgpu.sum(axis=0), kind="stable")
    partners = partners[partners != g][:NUM_PARTNERS]
    scores = state.swap_table(g, partners)
    # Only swaps the proxy sees as strict improvements are checked (on a short window the proxy is exact).
    bound = state.proxy_score() * (1.0 - GAIN_RTOL)
    checked = 0
    for flat in np.argsort(scores.ravel(), kind="stable"):
        k, i, j = (int(v) for v in np.unravel_index(int(flat), scores.shape))
        if not scores[k, i, j] < bound or checked == NUM_CHECKED:
            break
        h = int(partners[k])
        if state.one_swap_change(g, i, h, j) > 0:
            continue
        checked += 1
        if state.exact_swap(g, i, h, j) < base * (1.0 - GAIN_RTOL):
            state.swap(g, i, h, j)
            return True
    return False


def _retarget(state: SearchState, num_targets: int, base: float) -> bool:
    """Re-points one redundant copy at one of the hottest experts (by load per copy) if that strictly lowers
    the exact score; the best proxy-ranked few are checked."""
    per_copy = (state.load / state.copies).sum(axis=0)
    targets = np.argsort(-per_copy, kind="stable")[:num_targets]
    slots, chosen, scores = state.retarget_table(targets, NUM_SOURCES)
    for k in np.argsort(scores, kind="stable")[:NUM_CHECKED]:
        if state.exact_retarget(int(slots[k]), int(chosen[k])) < base * (1.0 - GAIN_RTOL):
            state.phy2log[int(slots[k])] = int(chosen[k])
            state.refresh()
            return True
    return False


def local_search_path(
    layout: Layout, load: np.ndarray, *, max_passes: int = 8, num_targets: int = 4
) -> list[tuple[tuple[int, ...], float]]:
    """(phy2log, Σ_steps busiest GPU) of each layout local search passes through, from ``layout`` (first)
    to its result (last).

    A pass visits each GPU that is busiest at some step, most often busiest first, and applies the best
    improving swap between it and another GPU, repeatedly (at most once per partner GPU); then one
    re-targeting. It stops after a pass that changed
    nothing or after ``max_passes``. Each layout in the list scores strictly below the one before.
    """
    state = _state(layout, load)
    path = [(layout.phy2log, state.score())]
    for _ in range(max_passes):
        changed = False
        peak_counts = np.bincount(state.gpu_load.argmax(axis=1), minlength=state.num_gpus)
        for g in np.argsort(-peak_counts, kind="stable"):
            if peak_counts[g] == 0:
                break
            for _ in range(min(state.num_gpus - 1, NUM_PARTNERS)):
                if not _improving_swap(state, int(g), state.score()):
                    break
                path.append((tuple(state.phy2log.tolist()), state.score()))
                changed = True
        if num_targets > 0 and _retarget(state, num_targets, state.score()):
            path.append((tuple(state.phy2log.tolist()), state.score()))
            changed = True
        if not changed:
            break
    return path


def local_search(layout: Layout, load: np.ndarray, *, max_passes: int = 8, num_targets: int = 4) -> Layout:
    """Improves ``layout`` on ``load`` by swaps and re-targeting; each step strictly lowers the score."""
    phy2log = local_search_path(layout, load, max_passes=max_passes, num_targets=num_targets)[-1][0]
    return Layout(phy2log, layout.num_gpus, layout.num_logical)
