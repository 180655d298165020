"""The step-cost curve varlen verification ranks drafts against (DeepInfer's MTPVarlen reads step times
measured per graph size; walkthrough Pass 3, "Choosing how many drafts to check").

The engine records the wall time of every decode step under the graph size its plan fits
(``StepPlan.graph_size``: rows rounded up to a captured size) and, every ``refit_interval`` decode steps,
gives the scheduler a curve over every graph size:

- two or more sizes measured: the least-squares line ms = a + b · rows through the per-size mean times,
  with b ≥ 0 (a step never gets cheaper with more rows) and every value at least ``MIN_STEP_MS``;
- one size measured: below it, ms proportional to rows (no fixed cost, the pessimistic reading: varlen then
  drops the least likely drafts, so the steps that follow measure a smaller size); above it, the measured ms
  (unknown, so free: every draft with a chance of passing gets a row and the next step measures a larger
  size). Proportional above it too would trap varlen at its first size whenever that is the smallest a plan
  can take (batch 1 after steps whose drafts had confidence 0): no draft with confidence below 1 would pay a
  proportional row, so no second size would ever be measured;
- none yet: flat (1 ms at every size), so every draft with a chance of passing is verified and the
  first steps measure the largest sizes; a draft with confidence 0 adds no expected token and gets no row.

The curve depends on timing, so varlen's row counts do; the tokens of the deterministic mode and of
greedy decoding do not (docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence

# Floor of a fitted step time, so the curve stays positive (the scheduler refuses non-positive entries).
MIN_STEP_MS = 1e-3


class StepCostMeter:
    def __init__(self, graph_sizes: Sequence[int], refit_interval: int = 16) -> None:
        """``graph_sizes``: the scheduler's decode sizes (``SchedulerConfig.graph_sizes``), ascending."""
        if not graph_sizes:
            raise ValueError("the step-cost curve needs at least one graph size")
        if refit_interval < 1:
            raise ValueError(f"refit_interval must be at least 1, got {refit_interval}")
        self.graph_sizes = list(graph_sizes)
        self.refit_interval = refit_interval
        self.num_steps = 0  # decode steps recorded
        self._total_ms: dict[int, float] = {}  # per graph size: the sum of its steps' milliseconds
        self._count: dict[int, int] = {}  # per graph size: how many steps

    def record(self, graph_size: int, ms: float) -> bool:
        """One decode step's wall time. True when a new curve is due (every ``refit_interval`` steps)."""
        if ms <= 0:
            return False
        self._total_ms[graph_size] = self._total_ms.get(graph_size, 0.0) + ms
        self._count[graph_size] = self._count.get(graph_size, 0) + 1
        self.num_steps += 1
        return self.num_steps % self.refit_interval == 0

    @property
    def measured(self) -> bool:
        """Two or more sizes measured: the curve is a fit, not a guess (flat, or proportional from one size),
        so the scheduler may let it stop the draft from proposing (``StepPlan.propose_drafts``)."""
        return len(self._count) >= 2

    def curve(self) -> dict[int, float]:
        """Milliseconds per graph size."""
        means = {size: self._total_ms[size] / self._count[size] for size in self._total_ms}
        if not means:
            return {s: 1.0 for s in self.graph_sizes}
        if len(means) == 1:
            ((size, ms),) = means.items()
            return {s: max(ms * min(s, size) / size, MIN_STEP_MS) for s in self.graph_sizes}
        xs, ys = list(means), list(means.values())
        mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
        b = max(sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs), 0.0)
        a = my - b * mx
        return {s: max(a + b * s, MIN_STEP_MS) for s in self.graph_sizes}
