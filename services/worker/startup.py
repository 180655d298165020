"""Where a starting engine is, from the first byte loaded to ready: one vocabulary of phases from the worker to the
API (/health, grpc.health's trailing metadata, `shinkai up`'s progress line, the engine's "ready" event).

| phase | where it happens | counted steps |
|---|---|---|
| ``loading`` | the weights onto the device (``LLM``: ``load_model``) | parts placed (kernel form) |
| ``profiling`` | the profiled step that sizes the pools (services/engine/pool_sizing.py) | none |
| ``capturing`` | the CUDA graphs of every decode size and speculative bucket (services/worker/build.py) | graphs |
| ``compiling`` | the warm-up: synthetic requests through every step shape (services/engine/warmup.py) | requests |

Code that does a phase's work reports into the process's one ``PROGRESS``, from any thread::

    from services.worker import startup

    with startup.phase("compiling", total=len(variants)) as step:
        for variant in variants:
            compile(variant)
            step.advance(str(variant))   # done += 1; the detail names what just finished

or sets the count outright with ``step.count(done, total)`` where it counts its own steps (the warm-up).

Readers take ``PROGRESS.state()`` (plain data) whenever they answer a probe; ``PROGRESS.durations()`` gives the
seconds each phase took. A phase entered inside another (a throwaway engine's inside the pool profile) pauses the
outer one: the durations add up to the time spent, each second counted once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

log = logging.getLogger("shinkai.startup")

PHASES = ("loading", "profiling", "compiling", "capturing")

METADATA_KEY = "shinkai-startup"
"""The trailing metadata of a starting process's grpc.health Check: its ``StartupState`` as JSON
(``to_json``; services/gateway/startup_server.py)."""


@dataclass(frozen=True)
class StartupState:
    phase: str | None  # the phase under way (one of PHASES); None before the first and after the last
    done: int  # steps of it finished (graphs captured, variants compiled)
    total: int | None  # its steps; None: not counted
    detail: str | None  # what the last step was ("64 rows")
    phase_s: float  # seconds since the phase began
    started_s: float  # seconds since the first phase began (0 before it)

    def describe(self, bar_width: int = 0) -> str:
        """One line: ``capturing 3/11 (64 rows) 12 s``, with a ``[###-------]`` bar of ``bar_width`` where the
        phase counts its steps; ``starting`` before the first phase, ``between phases`` after one."""
        if self.phase is None:
            return "starting" if self.started_s == 0 else "between phases"
        count = ""
        if self.total is not None:
            filled = bar_width * self.done // max(self.total, 1)
            bar = f" [{'#' * filled}{'-' * (bar_width - filled)}]" if bar_width else ""
            count = f"{bar} {self.done}/{self.total}"
        detail = f" ({self.detail})" if self.detail else ""
        return f"{self.phase}{count}{detail} {self.phase_s:.0f} s"

    def to_json(self) -> str:
        return json.dumps(
            {**dataclasses.asdict(self), "phase_s": round(self.phase_s, 1), "started_s": round(self.started_s, 1)}
        )

    @classmethod
    def from_json(cls, text: str) -> StartupState:
        return cls(**json.loads(text))


class PhaseStep:
    """The handle a phase's ``with`` block gets: ``advance()`` after each step."""

    def __init__(self, progress: StartupProgress, frame: _Frame) -> None:
        self._progress = progress
        self._frame = frame

    def advance(self, detail: str | None = None) -> None:
        with self._progress.lock:
            self._frame.done += 1
            self._frame.detail = detail

    def count(self, done: int, total: int | None) -> None:
        """Sets the steps done and the total outright, for a caller that counts its own (the warm-up)."""
        with self._progress.lock:
            self._frame.done = done
            self._frame.total = total


@dataclass
class _Frame:
    phase: str
    total: int | None
    begun: float
    resumed: float  # when it last became the innermost phase
    done: int = 0
    detail: str | None = None


class StartupProgress:
    """The phases of one process's start (thread-safe)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.lock = threading.Lock()
        self._clock = clock
        self._stack: list[_Frame] = []
        self._seconds: dict[str, float] = {}
        self._first: float | None = None
        self.is_ready = False  # set once by the process when it serves (``ready()``)

    def ready(self) -> None:
        """The process serves from now on: what happens later (a compile) is no longer part of its start."""
        self.is_ready = True

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None) -> Iterator[PhaseStep]:
        if name not in PHASES:
            raise ValueError(f"unknown startup phase {name!r}: one of {', '.join(PHASES)}")
        now = self._clock()
        with self.lock:
            if self._first is None:
                self._first = now
            if self._stack:  # the outer phase pauses
                outer = self._stack[-1]
                self._seconds[outer.phase] = self._seconds.get(outer.phase, 0.0) + now - outer.resumed
            frame = _Frame(name, total, now, now)
            self._stack.append(frame)
        log.info("startup %s", json.dumps({"phase": name, "total": total}))
        try:
            yield PhaseStep(self, frame)
        finally:
            now = self._clock()
            with self.lock:
                self._stack.remove(frame)
                self._seconds[name] = self._seconds.get(name, 0.0) + now - frame.resumed
                if self._stack:
                    self._stack[-1].resumed = now
            seconds = round(now - frame.begun, 2)
            log.info("startup %s", json.dumps({"phase": name, "done": frame.done, "seconds": seconds}))

    def state(self) -> StartupState:
        now = self._clock()
        with self.lock:
            started = 0.0 if self._first is None else now - self._first
            if not self._stack:
                return StartupState(None, 0, None, None, 0.0, started)
            f = self._stack[-1]
            return StartupState(f.phase, f.done, f.total, f.detail, now - f.begun, started)

    def durations(self) -> dict[str, float]:
        """Seconds spent in each phase so far (finished ones, and the running ones up to now), rounded to 0.01."""
        now = self._clock()
        with self.lock:
            seconds = dict(self._seconds)
            if self._stack:
                inner = self._stack[-1]
                seconds[inner.phase] = seconds.get(inner.phase, 0.0) + now - inner.resumed
        return {p: round(seconds[p], 2) for p in PHASES if p in seconds}


PROGRESS = StartupProgress()
"""This process's start: every phase reports here, every probe reads it."""


def phase(name: str, total: int | None = None) -> contextlib.AbstractContextManager[PhaseStep]:
    """``PROGRESS.phase(name, total)``: see the module docstring."""
    return PROGRESS.phase(name, total)
