"""Triton's compiles in this process, counted and timed by startup phase (services/worker/startup.py) and after
ready: how much of a cold start's profile and capture was compiling, whether a warm cache left anything to compile,
and whether a request after ready waited on one (the engine's ``ready`` and ``stopped`` events carry the tally).

``install()`` (once per process, before anything compiles; idempotent) sets Triton's compilation listener, keeping
any listener already set (a test's) and calling it too. Triton calls it once per kernel variant a process first
launches: ``cache_hit`` says whether the variant came from the compile cache (services/cache_dirs.py) or was
compiled (``times``: the compiler's stages, in microseconds). A compile counts under the phase its thread works for
(``StartupProgress.working_phase``): a thread marked for a phase beside the others (the compile manifest's pool)
under that one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass

from services.worker.startup import PROGRESS, StartupProgress

AFTER_READY = "after_ready"  # the tally's key for what compiles once the process is ready
OUTSIDE = "outside_phases"  # before the first phase, or between two


@dataclass
class CompileTally:
    num_compiled: int = 0  # variants compiled (cache misses)
    num_cached: int = 0  # variants read from the compile cache
    compile_s: float = 0.0  # seconds the compiler took for the compiled ones


class CompileStats:
    def __init__(self, progress: StartupProgress) -> None:
        self.progress = progress  # whose phase each compile is counted under
        self._lock = threading.Lock()
        self._tallies: dict[str, CompileTally] = {}
        self._chained: Callable[..., None] | None = None
        self.installed = False

    def record(self, cache_hit: bool, micros: int) -> None:
        """One variant: read from the cache, or compiled in ``micros`` microseconds."""
        # The phase of the compiling thread: a precompile's pool beside ``loading`` counts under its own phase.
        key = AFTER_READY if self.progress.is_ready else self.progress.working_phase() or OUTSIDE
        with self._lock:
            tally = self._tallies.setdefault(key, CompileTally())
            if cache_hit:
                tally.num_cached += 1
            else:
                tally.num_compiled += 1
                tally.compile_s += micros / 1e6

    def _listener(self, *, src, metadata, metadata_group, times, cache_hit: bool) -> None:
        self.record(cache_hit, 0 if cache_hit else times.total)
        if self._chained is not None:
            self._chained(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)

    def install(self) -> None:
        try:
            from triton import knobs
        except ImportError:  # no Triton: nothing compiles, nothing to count
            return

        with self._lock:
            if self.installed:
                return
            self._chained = knobs.compilation.listener
            knobs.compilation.listener = self._listener
            self.installed = True

    def summary(self) -> dict[str, dict]:
        """Per phase (and ``after_ready``): {"num_compiled", "num_cached", "compile_s"}."""
        with self._lock:
            return {k: {**asdict(t), "compile_s": round(t.compile_s, 3)} for k, t in self._tallies.items()}


STATS = CompileStats(PROGRESS)
"""This process's compiles."""


def install() -> None:
    """``STATS.install()``: see the module docstring."""
    STATS.install()
