"""Seeded load windows and the comparison of policies on them (the "beats DeepSeek's balancer" study).

A case is a shape (experts, GPUs, redundant copies), a load kind and a seed. The same generator feeds the
golden-output script (``scripts/dev/eplb_deepseek_golden.py``), the tests and the benchmark in ``docs/eplb.md``,
so a case is reproducible from its name alone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

import numpy as np

from services.eplb.deepseek import deepseek_plan
from services.eplb.guarded import PlanConfig, plan
from services.eplb.layout import count_moves, moe_lb, startup_layout

LOAD_KINDS = ("uniform", "zipf", "onehot")

# (experts, GPUs, requested redundant copies) of the comparison: 16–256 experts over 4–64 GPUs.
SHAPES = ((16, 4, 4), (64, 8, 16), (128, 32, 32), (256, 64, 64))

# Steps per window and tokens per expert per step in the comparison (sums stay far below 2**24, where
# float32, which the reference plans in, resolves every count).
NUM_STEPS = 8
TOKENS_PER_EXPERT = 64


@dataclasses.dataclass(frozen=True)
class Case:
    """One seeded comparison case."""

    num_experts: int  # logical experts in the layer
    num_gpus: int  # expert-parallel size
    num_redundant: int  # requested extra copies (rounded up so slots divide by GPUs)
    kind: str  # one of LOAD_KINDS
    seed: int  # numpy seed of the window

    @property
    def name(self) -> str:
        return f"{self.num_experts}x{self.num_gpus}+{self.num_redundant}/{self.kind}/{self.seed}"

    def window(self) -> np.ndarray:
        return random_window(self.kind, self.num_experts, NUM_STEPS, self.num_experts * TOKENS_PER_EXPERT, self.seed)


def random_window(kind: str, num_experts: int, num_steps: int, tokens_per_step: int, seed: int) -> np.ndarray:
    """``steps × experts`` token counts drawn from one popularity per window.

    uniform: every expert equally popular; zipf: exponent 1 over a random ranking; onehot: one random
    expert takes half of the tokens, the rest uniform. Each step is a multinomial draw.
    """
    if kind not in LOAD_KINDS:
        raise ValueError(f"kind must be one of {', '.join(LOAD_KINDS)}, got {kind!r}")
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        probs = np.full(num_experts, 1.0 / num_experts)
    elif kind == "zipf":
        probs = 1.0 / (rng.permutation(num_experts) + 1.0)
    else:
        probs = np.full(num_experts, 0.5 / max(1, num_experts - 1))
        probs[rng.integers(num_experts)] = 0.5 if num_experts > 1 else 1.0
    probs = probs / probs.sum()
    return rng.multinomial(tokens_per_step, probs, size=num_steps).astype(np.int64)


def cases(per_shape: int, shapes: tuple[tuple[int, int, int], ...] = SHAPES) -> list[Case]:
    """``per_shape`` cases per shape, cycling through the load kinds, seeds 0, 1, …"""
    return [Case(e, g, r, LOAD_KINDS[seed % len(LOAD_KINDS)], seed) for e, g, r in shapes for seed in range(per_shape)]


def load_digest(summed: np.ndarray) -> str:
    """sha256 of a summed load as int64: ties golden outputs to the exact load they were made from."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(summed, dtype=np.int64)).tobytes()).hexdigest()


@dataclasses.dataclass(frozen=True)
class ShapeSummary:
    """Guarded against the reference over one shape's cases (both planned from the start-up layout)."""

    shape: tuple[int, int, int]  # (experts, GPUs, requested redundant copies)
    num_cases: int  # seeded loads
    reference_mean: float  # mean moe_lb of the reference's plans
    guarded_mean: float  # mean moe_lb of the guarded planner's layouts
    within_1pct: float  # share of cases with guarded ≤ 1.01 × reference
    num_worse: int  # cases where guarded is above the reference (beyond 1e-9 relative)
    num_better: int  # cases where guarded is below the reference (beyond 1e-9 relative)
    worst_ratio: float  # largest guarded / reference
    reference_moves: float  # mean slots the reference's plan changes from the start-up layout
    guarded_moves: float  # mean slots the guarded plan changes
    guarded_cpu_s: float  # mean CPU seconds per guarded plan


def compare_shape(shape: tuple[int, int, int], per_shape: int, *, summed: bool, config: PlanConfig) -> ShapeSummary:
    """Runs ``per_shape`` seeded cases of one shape; ``summed`` scores on the window's sum (one row)."""
    ours, theirs, our_moves, their_moves, cpu = [], [], [], [], 0.0
    for case in cases(per_shape, (shape,)):
        load = case.window().astype(np.float64)
        if summed:
            load = load.sum(axis=0)[None, :]
        start = startup_layout(case.num_experts, case.num_gpus, case.num_redundant)
        reference = deepseek_plan(load, start.num_gpus, start.num_slots)
        began = time.process_time()
        result = plan(load, start, config)
        cpu += time.process_time() - began
        ours.append(result.moe_lb_after)
        our_moves.append(result.moves)
        theirs.append(moe_lb(load, reference))
        their_moves.append(count_moves(start, reference))
    ours_a, theirs_a = np.array(ours), np.array(theirs)
    ratio = ours_a / theirs_a
    return ShapeSummary(
        shape,
        per_shape,
        float(theirs_a.mean()),
        float(ours_a.mean()),
        float(np.mean(ratio <= 1.01)),
        int(np.sum(ratio > 1 + 1e-9)),
        int(np.sum(ratio < 1 - 1e-9)),
        float(ratio.max()),
        float(np.mean(their_moves)),
        float(np.mean(our_moves)),
        cpu / per_shape,
    )
