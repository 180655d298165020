"""Where a starting engine is, from the first byte loaded to ready: one vocabulary of phases from the worker to the
API (/health, grpc.health's trailing metadata, `shinkai up`'s progress line, the engine's "ready" event).

| phase | where it happens | counted steps |
|---|---|---|
| ``loading`` | the weights onto the device (``LLM``: ``load_model``) | parts placed (kernel form) |
| ``profiling`` | the profiled step that sizes the pools (services/engine/pool_sizing.py) | none |
| ``capturing`` | the CUDA graphs of every decode size and speculative bucket (services/worker/build.py) | graphs |
| ``compiling`` | variants beside ``loading`` (services/engine/precompile.py); the warm-up (engine/warmup.py) | yes |

Code that does a phase's work reports into the process's one ``PROGRESS``, from any thread::

    from services.worker import startup

    with startup.phase("compiling", total=len(variants)) as step:
        for variant in variants:
            compile(variant)
            step.advance(str(variant))   # done += 1; the detail names what just finished

or sets the count outright with ``step.count(done, total)`` where it counts its own steps (the warm-up).

**A phase beside the others.** ``startup.beside("compiling")`` runs a phase on a thread of its own while the process
goes on through its phases (the compile manifest's precompile during ``loading``: services/engine/precompile.py).
The state reports the phase the process is in (``phase``, ``done`` …) and, in ``beside``, each phase running beside
it with its own count; where the process is between phases (waiting for the one beside to end), that one is
reported as the phase. Its seconds are its own wall time, so phases that overlapped add up to more than the start
took (``started_s`` is the start's wall time). Threads that do a beside phase's work call ``step.mark_thread()``
(the one that entered it is marked already): ``working_phase()`` then names it to them (services/worker/compile_stats.py
counts their compiles under it, not under the phase the process is in).

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
class BesideState:
    """A phase running beside the reported one, on another thread."""

    phase: str  # one of PHASES
    done: int  # steps of it finished
    total: int | None  # its steps; None: not counted
    phase_s: float  # seconds since it began


@dataclass(frozen=True)
class StartupState:
    phase: str | None  # the phase under way (one of PHASES); None before the first and after the last
    done: int  # steps of it finished (graphs captured, variants compiled)
    total: int | None  # its steps; None: not counted
    detail: str | None  # what the last step was ("64 rows")
    phase_s: float  # seconds since the phase began
    started_s: float  # seconds since the first phase began (0 before it)
    beside: tuple[BesideState, ...] = ()  # phases running beside this one on other threads, oldest first

    def describe(self, bar_width: int = 0) -> str:
        """One line: ``capturing 3/11 (64 rows) 12 s``, with a ``[###-------]`` bar of ``bar_width`` where the
        phase counts its steps; ``starting`` before the first phase, ``between phases`` after one; each phase beside it
        after a semicolon (``loading 3/10 12 s; beside: compiling 40/130 9 s``)."""
        if self.phase is None:
            return "starting" if self.started_s == 0 else "between phases"
        detail = f" ({self.detail})" if self.detail else ""
        line = f"{self.phase}{_count(self.done, self.total, bar_width)}{detail} {self.phase_s:.0f} s"
        for b in self.beside:
            line += f"; beside: {b.phase}{_count(b.done, b.total, 0)} {b.phase_s:.0f} s"
        return line

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        data["beside"] = [{**b, "phase_s": round(b["phase_s"], 1)} for b in data["beside"]]
        return json.dumps({**data, "phase_s": round(self.phase_s, 1), "started_s": round(self.started_s, 1)})

    @classmethod
    def from_json(cls, text: str) -> StartupState:
        data = json.loads(text)
        beside = tuple(BesideState(**_known(BesideState, b)) for b in data.pop("beside", ()))  # absent from older ones
        return cls(**_known(cls, data), beside=beside)


def _known(kind: type, data: dict) -> dict:
    """``data``'s keys that are fields of ``kind``: a newer process's state, read here, may carry more."""
    return {k: v for k, v in data.items() if k in kind.__dataclass_fields__}  # type: ignore[attr-defined]


def _count(done: int, total: int | None, bar_width: int) -> str:
    """`` [###---] 3/6`` (the bar where ``bar_width``), or nothing where the steps are not counted."""
    if total is None:
        return ""
    filled = bar_width * done // max(total, 1)
    bar = f" [{'#' * filled}{'-' * (bar_width - filled)}]" if bar_width else ""
    return f"{bar} {done}/{total}"


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

    def mark_thread(self) -> None:
        """The calling thread works for this phase until it ends (``StartupProgress.working_phase``): for a thread
        pool's workers, as their initializer."""
        self._progress.local.frame = self._frame


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
        self._beside: list[_Frame] = []  # phases beside the stack's, on other threads (module docstring)
        self._first: float | None = None
        self.local = threading.local()  # ``frame``: the beside phase the calling thread works for (``mark_thread``)
        self.is_ready = False  # set once by the process when it serves (``ready()``)

    def ready(self) -> None:
        """The process serves from now on: what happens later (a compile) is no longer part of its start."""
        self.is_ready = True

    def _begin(self, name: str, total: int | None) -> _Frame:
        """A frame of phase ``name`` begun now (the caller holds the lock); the first one marks the start."""
        if name not in PHASES:
            raise ValueError(f"unknown startup phase {name!r}: one of {', '.join(PHASES)}")
        now = self._clock()
        if self._first is None:
            self._first = now
        return _Frame(name, total, now, now)

    @contextlib.contextmanager
    def phase(self, name: str, total: int | None = None) -> Iterator[PhaseStep]:
        with self.lock:
            frame = self._begin(name, total)
            if self._stack:  # the outer phase pauses
                outer = self._stack[-1]
                self._seconds[outer.phase] = self._seconds.get(outer.phase, 0.0) + frame.begun - outer.resumed
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

    @contextlib.contextmanager
    def beside(self, name: str, total: int | None = None) -> Iterator[PhaseStep]:
        """A phase on the calling thread beside the process's others (module docstring); the calling thread is
        marked as working for it until it ends."""
        with self.lock:
            frame = self._begin(name, total)
            self._beside.append(frame)
        log.info("startup %s", json.dumps({"phase": name, "total": total, "beside": True}))
        step = PhaseStep(self, frame)
        step.mark_thread()
        try:
            yield step
        finally:
            now = self._clock()
            with self.lock:
                self._beside.remove(frame)
                self._seconds[name] = self._seconds.get(name, 0.0) + now - frame.begun
            self.local.frame = None
            seconds = round(now - frame.begun, 2)
            log.info("startup %s", json.dumps({"phase": name, "done": frame.done, "seconds": seconds, "beside": True}))

    def state(self) -> StartupState:
        now = self._clock()
        with self.lock:
            started = 0.0 if self._first is None else now - self._first
            frames = self._stack[-1:] + self._beside  # the reported phase first: the stack's, else the oldest beside
            if not frames:
                return StartupState(None, 0, None, None, 0.0, started)
            f, *others = frames
            beside = tuple(BesideState(b.phase, b.done, b.total, now - b.begun) for b in others)
            return StartupState(f.phase, f.done, f.total, f.detail, now - f.begun, started, beside)

    def working_phase(self) -> str | None:
        """The phase the calling thread works for: the beside phase it is marked for while that runs, else the
        reported phase (``state().phase``)."""
        frame = getattr(self.local, "frame", None)
        with self.lock:
            if frame is not None and frame in self._beside:
                return frame.phase
        return self.state().phase

    def durations(self) -> dict[str, float]:
        """Seconds spent in each phase so far (finished ones, and the running ones up to now), rounded to 0.01. A
        phase beside others counts its own wall time: overlapping phases add up to more than the start took."""
        now = self._clock()
        with self.lock:
            seconds = dict(self._seconds)
            if self._stack:
                inner = self._stack[-1]
                seconds[inner.phase] = seconds.get(inner.phase, 0.0) + now - inner.resumed
            for b in self._beside:
                seconds[b.phase] = seconds.get(b.phase, 0.0) + now - b.begun
        return {p: round(seconds[p], 2) for p in PHASES if p in seconds}


PROGRESS = StartupProgress()
"""This process's start: every phase reports here, every probe reads it."""


def phase(name: str, total: int | None = None) -> contextlib.AbstractContextManager[PhaseStep]:
    """``PROGRESS.phase(name, total)``: see the module docstring."""
    return PROGRESS.phase(name, total)


def beside(name: str, total: int | None = None) -> contextlib.AbstractContextManager[PhaseStep]:
    """``PROGRESS.beside(name, total)``: a phase beside the others, on the calling thread (module docstring)."""
    return PROGRESS.beside(name, total)
