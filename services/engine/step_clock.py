"""Varlen verification's measured step costs, the engine's side: it times decode steps and records them in the
``StepCostMeter`` (step_cost.py), whose refitted curve the scheduler plans with. Without varlen, or with the curve
given (``EngineConfig.spec_step_cost_ms``), nothing is timed."""

from __future__ import annotations

import time

from scheduler_rs import StepPlan
from services.engine.engine_parts import EngineParts
from services.engine.step_cost import StepCostMeter


class StepClock:
    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        config, scheduler = parts.config, parts.scheduler
        # The measured curve (None: given, or varlen off).
        self.meter: StepCostMeter | None = None
        self._last_read: float | None = None  # async: when the last decode step's result was read back
        if config.spec_step_cost_ms is not None:
            scheduler.set_step_cost(dict(config.spec_step_cost_ms))
        elif config.spec_varlen:
            self.meter = StepCostMeter(scheduler.config.graph_sizes)
            scheduler.set_step_cost(self.meter.curve(), measured=self.meter.measured())

    def took(self, plan: StepPlan, start: float) -> None:
        """A synchronous step, executed and read back, that began at ``start`` (``time.perf_counter``)."""
        if self._times(plan):
            self._record(plan, 1e3 * (time.perf_counter() - start))

    def read_back(self, plan: StepPlan) -> None:
        """An async step's result was read back now. A decode step's cost is the time between its read-back and the
        previous decode step's (it was queued behind that one, so the interval is its own device time, or the host's
        cadence where that is longer: either way what a step of its size costs). A prefill or empty step in between
        breaks the pair."""
        if self.meter is None:
            return
        now, timed = time.perf_counter(), self._times(plan)
        if timed and self._last_read is not None:
            self._record(plan, 1e3 * (now - self._last_read))
        self._last_read = now if timed else None

    def _times(self, plan: StepPlan) -> bool:
        """Whether the meter takes this step's time: a decode step with rows, under a graph size."""
        return self.meter is not None and plan.graph_size is not None and not plan.is_prefill and plan.num_rows > 0

    def _record(self, plan: StepPlan, ms: float) -> None:
        assert self.meter is not None
        if self.meter.record(plan.graph_size, ms, plan.num_requests):  # the next batch is most likely this one's
            self.parts.scheduler.set_step_cost(
                self.meter.curve(plan.num_requests), measured=self.meter.measured(plan.num_requests)
            )
