"""Expert layouts: the physical slots of one MoE layer, their maps, and moe_lb.

A layout is ``phy2log``: physical slot ``g * slots_per_gpu + k`` (the k-th slot of GPU g) holds a copy of
logical expert ``phy2log[slot]``. Every other view (copies per expert, logical-to-physical lists, expert
counts per GPU) is derived from it, so the maps cannot disagree.

Loads are ``steps × logical experts`` token counts. The gate splits an expert's tokens evenly between its
copies (DeepInfer's policy assumes the same), so a copy carries ``load / copies`` at every step.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

# Bytes of one routed expert of one layer in DeepSeek-V4.1 (MXFP4): w1, w3 (2304 × 5120) and w2
# (5120 × 2304) at 4 bits per weight, plus one e8m0 scale byte per row per 32 input columns.
V41_EXPERT_BYTES = 3 * 2304 * 5120 // 2 + 3 * (2304 * 5120 // 32)


class LayoutError(ValueError):
    """A layout that breaks an invariant (wrong size, unknown expert, an expert with no copy)."""


def total_redundant(num_logical: int, num_gpus: int, num_redundant: int) -> int:
    """DeepInfer's rounding: at least ``num_redundant`` extra copies, padded so all slots divide by GPUs.

    EP8, 384 experts, ≥ 32 copies: 416 slots, no padding. EP63, ≥ 63 copies: 447 → 504 slots, 120 extra.
    """
    if num_logical < 1 or num_gpus < 1 or num_redundant < 0:
        raise LayoutError(
            f"need num_logical ≥ 1, num_gpus ≥ 1, num_redundant ≥ 0; got {num_logical}, {num_gpus}, {num_redundant}"
        )
    padding = (-(num_logical + num_redundant)) % num_gpus
    return num_redundant + padding


@dataclasses.dataclass(frozen=True)
class Layout:
    """One layer's placement. Invariant: every logical expert has ≥ 1 slot; slots divide by GPUs."""

    phy2log: tuple[int, ...]  # logical expert held by each physical slot, GPU-major
    num_gpus: int  # expert-parallel size; GPU g owns slots [g * slots_per_gpu, (g + 1) * slots_per_gpu)
    num_logical: int  # logical experts in the layer

    def __post_init__(self) -> None:
        phy2log = tuple(int(e) for e in self.phy2log)
        object.__setattr__(self, "phy2log", phy2log)
        if self.num_gpus < 1 or self.num_logical < 1:
            raise LayoutError(f"num_gpus and num_logical must be ≥ 1, got {self.num_gpus}, {self.num_logical}")
        if len(phy2log) % self.num_gpus:
            raise LayoutError(f"{len(phy2log)} slots do not divide over {self.num_gpus} GPUs")
        bad = [e for e in phy2log if not 0 <= e < self.num_logical]
        if bad:
            raise LayoutError(f"slots name experts outside 0..{self.num_logical - 1}: {sorted(set(bad))[:5]}")
        missing = sorted(set(range(self.num_logical)) - set(phy2log))
        if missing:
            raise LayoutError(f"experts with no slot: {missing[:10]}")

    @property
    def num_slots(self) -> int:
        return len(self.phy2log)

    @property
    def slots_per_gpu(self) -> int:
        return self.num_slots // self.num_gpus

    def array(self) -> np.ndarray:
        return np.asarray(self.phy2log, dtype=np.int64)

    def copies(self) -> np.ndarray:
        """Copies per logical expert (DeepInfer's ``logcnt``)."""
        return np.bincount(self.array(), minlength=self.num_logical)

    def log2phy(self) -> list[list[int]]:
        """Physical slots of each logical expert, ascending."""
        slots: list[list[int]] = [[] for _ in range(self.num_logical)]
        for slot, expert in enumerate(self.phy2log):
            slots[expert].append(slot)
        return slots

    def gpu_of_slot(self) -> np.ndarray:
        return np.arange(self.num_slots) // self.slots_per_gpu

    def gpu_experts(self) -> list[list[int]]:
        """Experts on each GPU in slot order."""
        s = self.slots_per_gpu
        return [list(self.phy2log[g * s : (g + 1) * s]) for g in range(self.num_gpus)]

    def counts_per_gpu(self) -> np.ndarray:
        """``[expert, gpu]`` number of copies of that expert on that GPU."""
        counts = np.zeros((self.num_logical, self.num_gpus), dtype=np.int64)
        np.add.at(counts, (self.array(), self.gpu_of_slot()), 1)
        return counts

    def to_dict(self) -> dict:
        return {
            "num_gpus": self.num_gpus,
            "num_logical": self.num_logical,
            "slots_per_gpu": self.slots_per_gpu,
            "phy2log": list(self.phy2log),
            "log2phy": self.log2phy(),
            "gpus": self.gpu_experts(),
        }

    @classmethod
    def from_dict(cls, data: dict, num_logical: int | None = None) -> "Layout":
        """Reads ``to_dict`` output (or a plan, whose ``layout`` key holds it), strictly: counts and expert
        ids must be JSON integers (not strings, booleans or fractions), and redundant keys must agree.
        ``num_logical`` is the expected expert count when the data does not name one."""
        if not isinstance(data, dict):
            raise LayoutError("a layout is an object with 'phy2log' and 'num_gpus'")
        if isinstance(data.get("layout"), dict):
            data = data["layout"]
        if "phy2log" not in data or "num_gpus" not in data:
            raise LayoutError("a layout needs 'phy2log' and 'num_gpus'")
        phy2log = _int_list(data["phy2log"], "'phy2log'")
        num_gpus = _int_value(data["num_gpus"], "'num_gpus'", minimum=1)
        if "num_logical" in data:
            num_logical = _int_value(data["num_logical"], "'num_logical'", minimum=1)
        elif num_logical is None:
            num_logical = max(phy2log, default=-1) + 1
        if num_logical > len(phy2log):
            raise LayoutError(f"{num_logical} experts cannot fit in {len(phy2log)} slots")
        for slot, expert in enumerate(phy2log):
            if not 0 <= expert < num_logical:
                raise LayoutError(f"'phy2log' slot {slot} names expert {expert}, outside 0..{num_logical - 1}")
        layout = cls(tuple(phy2log), num_gpus, num_logical)
        if "slots_per_gpu" in data and _int_value(data["slots_per_gpu"], "'slots_per_gpu'") != layout.slots_per_gpu:
            raise LayoutError(f"'slots_per_gpu' disagrees with {layout.num_slots} slots over {num_gpus} GPUs")
        if "log2phy" in data:
            value = data["log2phy"]
            if not isinstance(value, list):
                raise LayoutError(f"'log2phy' must be a list of slot lists, got {type(value).__name__}")
            if [_int_list(v, f"'log2phy'[{e}]") for e, v in enumerate(value)] != layout.log2phy():
                raise LayoutError("'log2phy' disagrees with 'phy2log'")
        if "gpus" in data:
            value = data["gpus"]
            if not isinstance(value, list) or [_int_list(v, "'gpus' entry") for v in value] != layout.gpu_experts():
                raise LayoutError("'gpus' disagrees with 'phy2log'")
        return layout


def _int_value(value: object, what: str, minimum: int = 0) -> int:
    """A JSON integer ≥ ``minimum``; strings, booleans, fractions and other types are errors."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise LayoutError(f"{what} must be an integer, got {value!r}")
    if value < minimum:
        raise LayoutError(f"{what} must be ≥ {minimum}, got {value}")
    return value


def _int_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list):
        raise LayoutError(f"{what} must be a list of integers, got {type(value).__name__}")
    return [_int_value(v, f"{what} entry {k}") for k, v in enumerate(value)]


def startup_layout(num_logical: int, num_gpus: int, num_redundant: int) -> Layout:
    """DeepInfer's start-up layout: slots 0..N-1 hold experts 0..N-1, then copies of 0, 1, … in index order."""
    extra = total_redundant(num_logical, num_gpus, num_redundant)
    phy2log = list(range(num_logical)) + [i % num_logical for i in range(extra)]
    return Layout(tuple(phy2log), num_gpus, num_logical)


def check_load(load: np.ndarray, num_logical: int) -> np.ndarray:
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2 or load.shape[0] < 1 or load.shape[1] != num_logical:
        raise LayoutError(f"load must be steps × {num_logical} experts, got shape {load.shape}")
    return load


def gpu_loads(load: np.ndarray, layout: Layout) -> np.ndarray:
    """``[step, gpu]`` tokens each GPU processes, with each expert's tokens split evenly over its copies."""
    load = check_load(load, layout.num_logical)
    per_copy = load / layout.copies()[None, :]
    return per_copy @ layout.counts_per_gpu()


def peak_sum(gpu_load: np.ndarray) -> float:
    """Σ over steps of the busiest GPU: the quantity both stages of the policy minimise."""
    return float(gpu_load.max(axis=1).sum())


def moe_lb(load: np.ndarray, layout: Layout) -> float:
    """Σ_steps busiest GPU / Σ_steps mean GPU load (the walkthrough's formula, not a mean of ratios).

    1.0 is perfect balance. A window with no tokens at all is balanced by definition.
    """
    per_gpu = gpu_loads(load, layout)
    mean_sum = float(per_gpu.sum()) / layout.num_gpus
    if mean_sum <= 0.0:
        return 1.0
    return peak_sum(per_gpu) / mean_sum


def colocation_cap(copies: np.ndarray, num_gpus: int) -> np.ndarray:
    """Fewest copies of each expert the most crowded GPU must hold: ceil(copies / GPUs).

    Dealing copies round-robin always meets it, so a layout above it co-locates copies needlessly.
    """
    return -(-np.asarray(copies) // num_gpus)


def needless_colocations(layout: Layout) -> int:
    """Copies sitting on a GPU beyond ``colocation_cap`` (0 for a layout that spreads every expert)."""
    cap = colocation_cap(layout.copies(), layout.num_gpus)
    return int(np.maximum(layout.counts_per_gpu() - cap[:, None], 0).sum())


def count_moves(old: Layout, new: Layout) -> int:
    """Physical slots whose expert changes: each one loads one expert's weights."""
    if old.num_slots != new.num_slots or old.num_gpus != new.num_gpus:
        raise LayoutError(
            f"layouts differ in shape: {old.num_slots} slots / {old.num_gpus} GPUs vs {new.num_slots} / {new.num_gpus}"
        )
    return int(np.count_nonzero(old.array() != new.array()))


def is_close(a: float, b: float) -> bool:
    """Equal up to float noise from summing the same loads in another order."""
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
