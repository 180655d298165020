"""A layout under local search: its loads kept in step with edits, and vectorised scores of every edit.

Two views of the window are kept. ``load`` is exact: it decides whether an edit is accepted. ``proxy`` is
the window summed into at most ``PROXY_ROWS`` consecutive blocks of steps: it ranks edits cheaply. A
window of ``PROXY_ROWS`` steps or fewer is its own proxy, so small windows are searched exactly.
"""

from __future__ import annotations

import numpy as np

from services.eplb.layout import colocation_cap

# Rows of the proxy window that ranks edits (blocks of consecutive steps, summed).
PROXY_ROWS = 64


def proxy_rows(load: np.ndarray, num_rows: int = PROXY_ROWS) -> np.ndarray:
    """``load`` summed over ``num_rows`` near-equal blocks of consecutive steps (itself if no longer)."""
    if load.shape[0] <= num_rows:
        return load
    starts = np.linspace(0, load.shape[0], num_rows + 1).astype(np.int64)[:-1]
    return np.add.reduceat(load, starts, axis=0)


def _top3(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the three largest values (descending) and their columns; -inf / -1 pads beyond the width."""
    rows, cols = values.shape
    k = min(3, cols)
    idx = np.argpartition(-values, k - 1, axis=1)[:, :k] if cols > k else np.tile(np.arange(cols), (rows, 1))
    vals = np.take_along_axis(values, idx, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    idx, vals = np.take_along_axis(idx, order, axis=1), np.take_along_axis(vals, order, axis=1)
    if k < 3:
        idx = np.concatenate([idx, np.full((rows, 3 - k), -1)], axis=1)
        vals = np.concatenate([vals, np.full((rows, 3 - k), -np.inf)], axis=1)
    return vals, idx


class SearchState:
    """``phy2log`` being edited, with copies, per-GPU counts and slot/GPU loads (exact and proxy)."""

    def __init__(self, load: np.ndarray, phy2log: np.ndarray, num_gpus: int) -> None:
        self.load = np.asarray(load, dtype=np.float64)  # [step, expert] exact window
        self.proxy = proxy_rows(self.load)  # [row, expert] blocks of steps that rank edits
        self.phy2log = np.asarray(phy2log, dtype=np.int64).copy()  # [slot] expert
        self.num_gpus = num_gpus
        self.slots_per_gpu = len(self.phy2log) // num_gpus
        self.gpu = np.arange(len(self.phy2log)) // self.slots_per_gpu  # [slot] its GPU
        self.refresh()

    def refresh(self) -> None:
        """Recomputes every derived array from ``phy2log`` (after a change in copy counts)."""
        num_logical = self.load.shape[1]
        self.copies = np.bincount(self.phy2log, minlength=num_logical)
        self.held = np.zeros((num_logical, self.num_gpus), dtype=np.int64)  # [expert, gpu] copies there
        np.add.at(self.held, (self.phy2log, self.gpu), 1)
        self.cap = colocation_cap(self.copies, self.num_gpus)
        shape = (-1, self.num_gpus, self.slots_per_gpu)  # slots are GPU-major
        self.slot_load = (self.load / self.copies)[:, self.phy2log]  # [step, slot]
        self.gpu_load = self.slot_load.reshape(shape).sum(axis=2)  # [step, gpu]
        self.pslot = (self.proxy / self.copies)[:, self.phy2log]  # [row, slot]
        self.pgpu = self.pslot.reshape(shape).sum(axis=2)  # [row, gpu]
        self.pslot_by_gpu = np.ascontiguousarray(self.pslot.T).reshape(self.num_gpus, self.slots_per_gpu, -1)
        self._top: tuple[np.ndarray, np.ndarray] | None = None  # exact busiest load and GPU per step
        self._ptop: tuple[np.ndarray, np.ndarray] | None = None  # proxy top-three loads and GPUs per row

    def proxy_score(self) -> float:
        """Σ_rows busiest GPU on the proxy window."""
        return float(self.pgpu.max(axis=1).sum())

    def score(self) -> float:
        """Σ_steps busiest GPU on the exact window."""
        return float(self.peak()[0].sum())

    def peak(self) -> tuple[np.ndarray, np.ndarray]:
        """Per step of the exact window: the busiest GPU's load and index (cached until an edit)."""
        if self._top is None:
            arg = self.gpu_load.argmax(axis=1)
            self._top = (self.gpu_load[np.arange(len(arg)), arg], arg)
        return self._top

    def others(self, vals: np.ndarray, idx: np.ndarray, g: int, h: np.ndarray | int) -> np.ndarray:
        """Per row, the busiest GPU that is neither g nor h, from a top-three table (h may be a column)."""
        return np.where(
            (idx[..., 0] != g) & (idx[..., 0] != h),
            vals[..., 0],
            np.where((idx[..., 1] != g) & (idx[..., 1] != h), vals[..., 1], vals[..., 2]),
        )

    def excess(self) -> int:
        """Copies beyond ``colocation_cap`` on their GPU: needless co-locations."""
        return int(np.maximum(self.held - self.cap[:, None], 0).sum())

    def slots_of(self, g: int) -> np.ndarray:
        return np.arange(g * self.slots_per_gpu, (g + 1) * self.slots_per_gpu)

    def swap_table(self, g: int, partners: np.ndarray) -> np.ndarray:
        """``[k, i, j]`` proxy Σ_rows busiest GPU after swapping slot i of g with slot j of GPU
        ``partners[k]`` (g itself must not be a partner).

        With d = y_j - x_i the load g gains, max(L_g + d, L_h - d) = (L_g + L_h) / 2 + |d + (L_g - L_h) / 2|;
        the rest of the GPUs contribute the largest of the top three loads that is neither g nor h.
        """
        s = self.slots_per_gpu
        x = self.pslot[:, g * s : (g + 1) * s].T  # [i, row]
        y = self.pslot_by_gpu[partners]  # [k, j, row]
        lg, lh = self.pgpu[:, g], self.pgpu.T[partners]  # [row], [k, row]
        if self._ptop is None:
            self._ptop = _top3(self.pgpu)
        vals, idx = self._ptop
        others = self.others(vals[None], idx[None], g, partners[:, None])  # [k, row]
        work = y[:, None, :, :] - x[None, :, None, :]  # [k, i, j, row]
        work += ((lg[None, :] - lh) / 2)[:, None, None, :]
        np.abs(work, out=work)
        work += ((lg[None, :] + lh) / 2)[:, None, None, :]
        np.maximum(work, others[:, None, None, :], out=work)
        return work.sum(axis=3)

    def swap_change(self, g: int, partners: np.ndarray) -> np.ndarray:
        """``[k, i, j]`` change in needless co-locations from the swaps of ``swap_table`` (+inf where the
        swap is meaningless: the partner is g, or the experts are equal)."""
        s = self.slots_per_gpu
        a = self.phy2log[g * s : (g + 1) * s]  # [i]
        b = self.phy2log.reshape(self.num_gpus, s)[partners]  # [k, j]
        change = (
            -(self.held[a, g] > self.cap[a]).astype(np.float64)[None, :, None]
            + (self.held[a][:, partners].T >= self.cap[a][None, :])[:, :, None]
            - (self.held[b, partners[:, None]] > self.cap[b])[:, None, :]
            + (self.held[b, g] >= self.cap[b])[:, None, :]
        )
        change[a[None, :, None] == b[:, None, :]] = np.inf
        change[partners == g] = np.inf
        return change

    def one_swap_change(self, g: int, i: int, h: int, j: int) -> float:
        """``swap_change`` of one swap."""
        a, b = self.phy2log[g * self.slots_per_gpu + i], self.phy2log[h * self.slots_per_gpu + j]
        if a == b or g == h:
            return np.inf
        held, cap = self.held, self.cap
        return float(
            -int(held[a, g] > cap[a]) + int(held[a, h] >= cap[a]) - int(held[b, h] > cap[b]) + int(held[b, g] >= cap[b])
        )

    def exact_swap(self, g: int, i: int, h: int, j: int) -> float:
        """Σ_steps busiest GPU after that swap, on the exact window."""
        d = self.slot_load[:, self.slots_of(h)[j]] - self.slot_load[:, self.slots_of(g)[i]]
        top, arg = self.peak()
        pair = np.maximum(self.gpu_load[:, g] + d, self.gpu_load[:, h] - d)
        peak = np.maximum(top, pair)  # exact on steps whose busiest GPU is neither g nor h
        rows = np.flatnonzero((arg == g) | (arg == h))
        if len(rows):
            rest = np.ones(self.num_gpus, dtype=bool)
            rest[[g, h]] = False
            others = self.gpu_load[np.ix_(rows, rest)].max(axis=1) if rest.any() else np.full(len(rows), -np.inf)
            peak[rows] = np.maximum(others, pair[rows])
        return float(peak.sum())

    def swap(self, g: int, i: int, h: int, j: int) -> None:
        """Swaps two slots' experts, updating the derived arrays in O(steps) (copy counts are unchanged)."""
        s, t = self.slots_of(g)[i], self.slots_of(h)[j]
        a, b = self.phy2log[s], self.phy2log[t]
        self.phy2log[s], self.phy2log[t] = b, a
        self.held[a, g] -= 1
        self.held[a, h] += 1
        self.held[b, h] -= 1
        self.held[b, g] += 1
        for slots, gpus in ((self.slot_load, self.gpu_load), (self.pslot, self.pgpu)):
            d = slots[:, t] - slots[:, s]  # load g gains
            slots[:, [s, t]] = slots[:, [t, s]]
            gpus[:, g] += d
            gpus[:, h] -= d
        by_gpu = self.pslot_by_gpu  # [gpu, slot in gpu, row]: a view kept in step with pslot
        k, m = s % self.slots_per_gpu, t % self.slots_per_gpu
        by_gpu[g, k], by_gpu[h, m] = self.pslot[:, s], self.pslot[:, t]
        self._top = self._ptop = None

    def retarget_table(self, targets: np.ndarray, num_sources: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Proxy scores of re-pointing one redundant copy (slot s, expert a with ≥ 2 copies) at a target b.

        Sources are the ``num_sources`` redundant slots whose experts carry the least load per copy (the
        copies that help least). Returns (slots, targets, scores) over the allowed pairs: b != a, and
        neither expert ends above ``colocation_cap`` on any GPU.
        """
        slots = np.flatnonzero(self.copies[self.phy2log] >= 2)
        per_copy = self.proxy.sum(axis=0) / self.copies
        slots = slots[np.argsort(per_copy[self.phy2log[slots]], kind="stable")[:num_sources]]
        s, b = (arr.ravel() for arr in np.meshgrid(slots, targets, indexing="ij"))
        a = self.phy2log[s]
        keep = a != b
        s, b, a = s[keep], b[keep], a[keep]
        if len(s) == 0:
            return s, b, np.zeros(0)
        num_gpus = self.num_gpus
        at = (np.arange(num_gpus)[None, :] == self.gpu[s][:, None]).astype(np.float64)  # [pair, gpu]
        ca, cb = self.copies[a][:, None], self.copies[b][:, None]
        held_a, held_b = self.held[a].astype(np.float64), self.held[b].astype(np.float64)
        new_a, new_b = held_a - at, held_b + at
        cap_a = -(-(ca - 1) // num_gpus)
        cap_b = -(-(cb + 1) // num_gpus)
        ok = (new_a <= cap_a).all(axis=1) & (new_b <= cap_b).all(axis=1)
        da = new_a / (ca - 1) - held_a / ca  # [pair, gpu] change in a's share per GPU
        db = new_b / (cb + 1) - held_b / cb
        trial = (
            self.pgpu[None, :, :]
            + self.proxy.T[a][:, :, None] * da[:, None, :]
            + self.proxy.T[b][:, :, None] * db[:, None, :]
        )  # [pair, row, gpu]
        scores = trial.max(axis=2).sum(axis=1)
        return s[ok], b[ok], scores[ok]

    def exact_retarget(self, slot: int, target: int) -> float:
        """Σ_steps busiest GPU on the exact window after re-pointing ``slot`` at ``target``."""
        a, b, at = self.phy2log[slot], target, np.arange(self.num_gpus) == self.gpu[slot]
        ca, cb = self.copies[a], self.copies[b]
        da = (self.held[a] - at) / (ca - 1) - self.held[a] / ca
        db = (self.held[b] + at) / (cb + 1) - self.held[b] / cb
        trial = self.gpu_load + np.outer(self.load[:, a], da) + np.outer(self.load[:, b], db)
        return float(trial.max(axis=1).sum())
