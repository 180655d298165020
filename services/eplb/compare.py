"""Seeded load windows and the comparison of policies on them (the "beats DeepSeek's balancer" study).

A case is a shape (experts, GPUs, redundant copies), a load kind and a seed. The same generator feeds the
golden-output script (``scripts/eplb_deepseek_golden.py``), the tests and the benchmark in ``docs/eplb.md``,
so a case is reproducible from its name alone.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

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
        return random_window(self.kind, self.num_experts, NUM_STEPS, self.num_experts * TOKENS_PER_EXPERT,
                             self.seed)


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
    return [Case(e, g, r, LOAD_KINDS[seed % len(LOAD_KINDS)], seed)
            for e, g, r in shapes for seed in range(per_shape)]


def load_digest(summed: np.ndarray) -> str:
    """sha256 of a summed load as int64: ties golden outputs to the exact load they were made from."""
    return hashlib.sha256(np.ascontiguousarray(np.asarray(summed, dtype=np.int64)).tobytes()).hexdigest()
