"""The step-cost curve varlen verification ranks drafts against (DeepInfer's MTPVarlen reads step times
measured per graph size; walkthrough Pass 3, "Choosing how many drafts to check").

The engine records the wall time of every decode step under the graph size its plan fits
(``StepPlan.graph_size``: rows rounded up to a captured size) and the batch's request bucket (``request_bucket``:
its request count rounded up to a power of two), and gives the scheduler the curve of the latest step's bucket
every ``refit_interval`` decode steps and whenever the bucket changes. A step's cost depends on how many requests
its rows belong to (each request's context, its own experts), not on rows alone: the same rows took
longer at 64 requests than at 16, and one curve for both priced batch 16's drafts by batch 64's steps
(docs/speculative.md). Within a bucket the curve over every graph size is:

- two or more sizes measured: the per-size mean times, made non-decreasing in rows (a step never gets
  cheaper with more rows: adjacent sizes that break it are pooled into their count-weighted mean), joined
  by straight lines. Below the smallest measured size the first segment's line continues; above the
  largest the curve stays at the largest's time (unknown, so free, as for one size: the next step that
  can use more rows measures them). Every value is at least ``MIN_STEP_MS``. One line through all the
  means (this meter's first fit) overstated the rows past a bend: at batch 16 the step time rose steeply up
  to 45 rows and little past them, the line's slope priced the rows past 45 as dear as those before, and varlen verified
  fewer drafts than paid (docs/speculative.md);
- one size measured: below it, ms proportional to rows (no fixed cost, the pessimistic reading: varlen then
  drops the least likely drafts, so the steps that follow measure a smaller size); above it, the measured ms
  (unknown, so free: every draft with a chance of passing gets a row and the next step measures a larger
  size). Proportional above it too would trap varlen at its first size whenever that is the smallest a plan
  can take (batch 1 after steps whose drafts had confidence 0): no draft with confidence below 1 would pay a
  proportional row, so no second size would ever be measured;
- none yet (a bucket not seen before): flat (1 ms at every size), so every draft with a chance of passing is
  verified and the first steps measure the largest sizes; a draft with confidence 0 adds no expected token and
  gets no row.

The curve depends on timing, so varlen's row counts do; the tokens of the deterministic mode and of
greedy decoding do not (docs/speculative.md).
"""

from __future__ import annotations

from collections.abc import Sequence

# Floor of a fitted step time, so the curve stays positive (the scheduler refuses non-positive entries).
MIN_STEP_MS = 1e-3


def request_bucket(num_requests: int) -> int:
    """The power of two at or above ``num_requests`` (1 for 0 or 1): batches in one bucket share a curve."""
    return 1 << max(num_requests - 1, 0).bit_length()


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
        self._times: dict[int, _SizeTimes] = {}  # per request bucket: its steps' times per graph size
        self._last_bucket: int | None = None  # the latest recorded step's bucket

    def record(self, graph_size: int, ms: float, num_requests: int = 1) -> bool:
        """One decode step's wall time, its batch ``num_requests`` requests. True when a new curve is due: every
        ``refit_interval`` steps, and when this step's bucket is not the previous step's (the scheduler then needs
        this bucket's curve; before the first step it holds the flat curve of a bucket with no steps)."""
        if ms <= 0:
            return False
        bucket = request_bucket(num_requests)
        self._times.setdefault(bucket, _SizeTimes()).add(graph_size, ms)
        self.num_steps += 1
        changed = self._last_bucket is not None and bucket != self._last_bucket
        self._last_bucket = bucket
        return changed or self.num_steps % self.refit_interval == 0

    def measured(self, num_requests: int = 1) -> bool:
        """Two or more sizes measured in the bucket: its curve is a fit, not a guess (flat, or proportional from one
        size), so the scheduler may let it stop the draft from proposing (``StepPlan.propose_drafts``)."""
        return len(self.means(num_requests)) >= 2

    def means(self, num_requests: int = 1) -> dict[int, tuple[float, int]]:
        """Per measured graph size of the bucket: the mean step milliseconds and how many steps."""
        times = self._times.get(request_bucket(num_requests))
        return {} if times is None else times.means()

    def all_means(self) -> dict[int, dict[int, tuple[float, int]]]:
        """``means`` of every bucket with steps, by bucket."""
        return {bucket: self._times[bucket].means() for bucket in sorted(self._times)}

    def curve(self, num_requests: int = 1) -> dict[int, float]:
        """Milliseconds per graph size for a batch of ``num_requests`` requests."""
        means = self.means(num_requests)
        if not means:
            return {s: 1.0 for s in self.graph_sizes}
        if len(means) == 1:
            ((size, (ms, _)),) = means.items()
            return {s: max(ms * min(s, size) / size, MIN_STEP_MS) for s in self.graph_sizes}
        xs, ys = _non_decreasing(list(means), *zip(*means.values()))
        return {s: max(_interpolate(xs, ys, s), MIN_STEP_MS) for s in self.graph_sizes}


class _SizeTimes:
    """One bucket's step times, summed per graph size."""

    def __init__(self) -> None:
        self._total_ms: dict[int, float] = {}  # per graph size: the sum of its steps' milliseconds
        self._count: dict[int, int] = {}  # per graph size: how many steps

    def add(self, graph_size: int, ms: float) -> None:
        self._total_ms[graph_size] = self._total_ms.get(graph_size, 0.0) + ms
        self._count[graph_size] = self._count.get(graph_size, 0) + 1

    def means(self) -> dict[int, tuple[float, int]]:
        return {size: (self._total_ms[size] / self._count[size], self._count[size]) for size in sorted(self._total_ms)}


def _non_decreasing(xs: Sequence[int], ys: Sequence[float], weights: Sequence[int]) -> tuple[list[float], list[float]]:
    """Pool-adjacent-violators: the non-decreasing ys closest to ``ys`` in weighted least squares; a pooled run
    keeps one point at its weighted mean size, so every kept point is a measurement or a mean of them."""
    blocks: list[list[float]] = []  # [weighted size sum, weighted time sum, weight]
    for x, y, w in zip(xs, ys, weights):
        blocks.append([x * w, y * w, w])
        while len(blocks) > 1 and blocks[-2][1] / blocks[-2][2] > blocks[-1][1] / blocks[-1][2]:
            last = blocks.pop()
            blocks[-1] = [blocks[-1][0] + last[0], blocks[-1][1] + last[1], blocks[-1][2] + last[2]]
    return [b[0] / b[2] for b in blocks], [b[1] / b[2] for b in blocks]


def _interpolate(xs: list[float], ys: list[float], size: int) -> float:
    """The piecewise-linear curve through (xs, ys) at ``size``: the first segment continued below xs[0], flat
    at ys[-1] above xs[-1] (a single point: flat everywhere)."""
    if size >= xs[-1] or len(xs) == 1:
        return ys[-1]
    i = 1
    while i < len(xs) - 1 and xs[i] < size:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (size - x0) / (x1 - x0)
