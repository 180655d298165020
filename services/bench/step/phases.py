"""Host ms per decode step, split by phase, measured around a live engine (`shinkai bench step`'s host and
offline rows; the offline rows alone: ``python -m services.bench.step.offline``).

``StepPhases.attach(engine)`` wraps the engine's collaborators (never its private methods) with clocks:

- ``schedule``: the Rust scheduler's ``schedule``;
- ``launch``: the runner's ``execute`` (the step's input preparation and, on a GPU, the queued forward or
  graph replay; on the CPU the forward itself);
- ``sample``: the sampler call (queued on a GPU);
- ``read``: the first access of a step's ``result``: on a GPU the wait for that step's device work, then
  the token lists;
- ``update``: the scheduler's ``update``;
- ``other``: the rest of ``Engine.step`` (sampling rows, the worker's bookkeeping, outputs, finishes).

A sample is one ``Engine.step`` call whose plan is a decode step with rows; with async scheduling that call
also reads and updates the step before it. On a GPU with async scheduling working, ``read`` holds the
host's idle wait for the device and the other phases are what the device's step must cover; with it off,
``read`` is the whole device step. The clocks cost a few perf_counter calls per step (microseconds).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import defaultdict
from typing import Any

PHASES = ("schedule", "launch", "sample", "read", "update", "other")


class _Timed:
    """A proxy: ``name``'s calls on ``target`` are timed into ``phase``; everything else passes through."""

    def __init__(self, target: Any, name: str, phase: str, clock: StepPhases) -> None:
        self._target, self._name, self._phase, self._clock = target, name, phase, clock

    def __getattr__(self, attr: str) -> Any:
        if attr != self._name:
            return getattr(self._target, attr)
        method = getattr(self._target, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._clock.timing(self._phase):
                return method(*args, **kwargs)

        return timed


class _TimedResult:
    """A worker output whose ``result`` is timed into ``read``; everything else passes through."""

    def __init__(self, out: Any, clock: StepPhases) -> None:
        self._out, self._clock = out, clock

    @property
    def result(self) -> Any:
        with self._clock.timing("read"):
            return self._out.result

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._out, attr)


class StepPhases:
    def __init__(self) -> None:
        self.samples: list[dict[str, float]] = []  # per timed decode step: phase → ms
        self._current: dict[str, float] = defaultdict(float)
        self._decode = False  # the current Engine.step call scheduled a decode step with rows
        self._undo: list[tuple[Any, str, Any]] = []  # (object, attribute, its value before attach)
        self._shadowed: list[Any] = []  # the worker and engine whose methods an instance attribute shadows

    @contextlib.contextmanager
    def timing(self, phase: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._current[phase] += 1e3 * (time.perf_counter() - t0)

    def attach(self, engine: Any) -> None:
        """Wraps ``engine``'s scheduler, worker, runner and sampler, and its ``step``; ``detach`` undoes it."""
        worker, scheduler = engine.worker, engine.scheduler
        clock = self

        class _Scheduler(_Timed):
            def schedule(self) -> Any:
                with clock.timing("schedule"):
                    plan = scheduler.schedule()
                clock._decode = plan.kind == "decode" and plan.num_rows > 0
                return plan

        execute, step = worker.execute, engine.step
        sampler = worker.sampler

        def timed_execute(*args: Any, **kwargs: Any) -> Any:
            args = tuple(a._out if isinstance(a, _TimedResult) else a for a in args)
            return _TimedResult(execute(*args, **kwargs), clock)

        def timed_sampler(*args: Any, **kwargs: Any) -> Any:
            with clock.timing("sample"):
                return sampler(*args, **kwargs)

        def timed_step() -> Any:
            self._current, self._decode = defaultdict(float), False
            t0 = time.perf_counter()
            outputs = step()
            total = 1e3 * (time.perf_counter() - t0)
            if self._decode:
                sample = {phase: self._current[phase] for phase in PHASES[:-1]}
                sample["other"] = total - sum(sample.values())
                sample["total"] = total
                self.samples.append(sample)
            return outputs

        self._undo = [(engine, "scheduler", scheduler), (worker, "runner", worker.runner), (worker, "sampler", sampler)]
        engine.scheduler = _Scheduler(scheduler, "update", "update", self)
        worker.runner = _Timed(worker.runner, "execute", "launch", self)
        worker.sampler = timed_sampler
        worker.execute = timed_execute  # instance attributes: ``detach`` deletes them
        engine.step = timed_step
        self._shadowed = [worker, engine]

    def detach(self) -> None:
        for obj, attr, value in self._undo:
            setattr(obj, attr, value)
        worker, engine = self._shadowed
        del worker.execute, engine.step
        self._undo = []

    def summary(self) -> dict[str, float]:
        """Median ms per timed decode step of each phase and of the whole call (``total``)."""
        if not self.samples:
            return {}
        return {k: statistics.median(s[k] for s in self.samples) for k in (*PHASES, "total")}


def describe(summary: dict[str, float]) -> str:
    return "  ".join(f"{k} {summary[k]:.2f}" for k in (*PHASES, "total"))
