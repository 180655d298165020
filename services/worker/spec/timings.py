"""Host time of the speculator's steps, by phase: where a speculative step's host work goes (the benchmark's
split, services/bench/speculative/run.py). Measured with ``time.perf_counter`` around the step's own calls, with
no device sync added: on CUDA a phase's time is the host's (Python, dispatch, launches, and any blocking
copy or read it makes, which waits for the device work queued before it); the step's one read ("read")
waits for everything queued, so device time not hidden behind the host shows up there."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PHASES = ("sample", "verify", "propose", "read", "other")
"""sample: the processed distributions and the step's sampler output; verify: the verdicts and the draft's
context K=V of the accepted rows; propose: the draft's proposal (host inputs, buffer fill, graph replay or
eager run); read: the step's one device → host read; other: the rest of the step (plan bookkeeping, the
per-request loops over the read)."""


@dataclass
class SpecTimings:
    """Totals over the speculator's steps since the last ``reset``."""

    num_steps: int = 0  # speculator steps (every step with a sampling or prompt row)
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # phase → host seconds

    def reset(self) -> None:
        self.num_steps = 0
        self.seconds = dict.fromkeys(PHASES, 0.0)

    def add(self, phase: str, since: float) -> float:
        """Adds the time from ``since`` (a ``time.perf_counter()``) to now to ``phase``; returns now."""
        now = time.perf_counter()
        self.seconds[phase] += now - since
        return now

    def ms_per_step(self) -> dict[str, float]:
        """phase → host ms per step (and "total"), 0 before any step."""
        per = {p: 1000 * s / self.num_steps if self.num_steps else 0.0 for p, s in self.seconds.items()}
        per["total"] = sum(per.values())
        return per
