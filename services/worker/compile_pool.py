"""Kernel variants compiled in processes of their own, into Triton's file cache, before any launch needs them.

A Triton compile is mostly Python (the code generator, and MLIR's passes called with the GIL held) plus a ptxas
subprocess: on threads of one process the engine's variants reached about 3.4× on 16 cores (docs/serving.md,
"Measured"). ``CompilePool`` compiles them in processes instead, one variant at a time each, with no GIL between them:

- **What it compiles: entries**, the compile manifest's form (services/worker/compile_manifest.py): a kernel's
  module and qualified name, and Triton's ``specialization_data`` of one variant (its signature, constexprs,
  alignment attributes and options). A manifest's entries are an earlier start's variants; ``listed`` gives the
  entries of code that compiles without launching (``JITFunction.warmup``: the sampler's variants), without
  compiling them.
- **The processes** are spawned (the engine's process holds a CUDA context and threads, which a fork would copy),
  run at a lower CPU priority than the engine (``NICENESS``), see no GPU (``CUDA_VISIBLE_DEVICES`` empty: no
  context of theirs counts against the pool profile's free memory) and compile for the engine's GPU through
  ``TargetDriver``, a Triton driver that names the engine's target (its backend, architecture and warp size) and
  has no device behind it. They inherit the engine's environment, so
  Triton's cache directory and every variable in its cache key are the engine's (services/cache_dirs.py).
- **What the engine does after**: Triton writes a compiled variant into its file cache whole (a group of files
  under a temporary name, then renamed into place), keyed by the source, the target, the options and the
  environment, none of which depends on the process. The engine's own ``JITFunction.preload`` of the same entry, or
  the launch that needs it, then reads it from there: a file-cache hit, milliseconds instead of seconds.

An entry whose compile fails in a process is counted (``Ahead.num_failed``); the launch that needs that variant
compiles it as it would have. ``close`` cancels the compiles not begun and leaves the processes to end.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("shinkai.worker.compile_pool")

NICENESS = 10
"""Added to the pool processes' nice value (Linux: 0 → 10), so the engine's own threads run first."""
Target = tuple[str, int, int]
"""Triton's ``GPUTarget`` as plain data: (backend, arch, warp_size), e.g. ("cuda", 90, 32) for an H100."""


def current_target() -> Target:
    """The target Triton compiles for on the calling thread's current device."""
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return (target.backend, int(target.arch), int(target.warp_size))


def target_driver(target: Target):
    """A Triton driver that compiles for ``target`` with no device behind it (nothing can be launched on it)."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class TargetDriver(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return True

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self) -> GPUTarget:
            return GPUTarget(*target)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_benchmarker(self):
            raise NotImplementedError("nothing runs on this driver")

        def get_current_device(self) -> int:
            return 0

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

    return TargetDriver()


def entry_of(module: str, qualname: str, specialization_data: str) -> dict[str, str]:
    """One variant as an entry (the compile manifest's form)."""
    return {"module": module, "qualname": qualname, "specialization_data": specialization_data}


@contextlib.contextmanager
def listed() -> Iterator[list[dict[str, str]]]:
    """Within the block, a variant that would compile is neither compiled nor launched: its entry is added to the
    list yielded (Triton's ``knobs.runtime.jit_cache_hook`` returning True skips the compile; a launch then returns
    nothing, so only code that does not launch, e.g. ``JITFunction.warmup``, belongs in the block). Variants
    already in a kernel's in-process table are not listed (they need no compile)."""
    from triton import knobs

    found: list[dict[str, str]] = []
    previous = knobs.runtime.jit_cache_hook

    def skip(**kwargs: object) -> bool:
        fn, job = kwargs["fn"], kwargs["compile"]  # Triton's JitFunctionInfo; the compile's arguments
        found.append(entry_of(fn.module, fn.name, job["specialization_data"]))  # type: ignore[attr-defined,index]
        return True

    knobs.runtime.jit_cache_hook = skip
    try:
        yield found
    finally:
        knobs.runtime.jit_cache_hook = previous


@dataclass
class Ahead:
    """Entries handed to a ``CompilePool``: their compiles, each a future of its seconds."""

    futures: list[concurrent.futures.Future] = field(default_factory=list)

    def wait(self, progress=None, stop=None) -> Ahead:
        """Until every compile has ended (or ``stop``, an Event, is set: those not begun are left); ``progress(done,
        total)`` after each one."""
        pending = set(self.futures)
        done = 0
        while pending and not (stop is not None and stop.is_set()):
            ended, pending = concurrent.futures.wait(pending, timeout=0.5, return_when="FIRST_COMPLETED")
            done += len(ended)
            if ended and progress is not None:
                progress(done, len(self.futures))
        return self

    @property
    def num_failed(self) -> int:
        """Compiles that ended with an error or were cancelled (their variants compile when launched)."""
        return sum(1 for f in self.futures if f.done() and (f.cancelled() or f.exception() is not None))

    @property
    def seconds(self) -> float:
        """The compiles' own seconds, summed over the processes (those ended)."""
        return sum(f.result() for f in self.futures if f.done() and not f.cancelled() and f.exception() is None)


class CompilePool:
    """Processes compiling entries for ``target`` into Triton's file cache (module docstring)."""

    def __init__(self, target: Target, num_processes: int) -> None:
        self.target = target  # what the processes compile for (``current_target()`` on the engine's device)
        self.num_processes = num_processes  # at most this many at once, started as the work needs them
        self._executor = concurrent.futures.ProcessPoolExecutor(
            max_workers=num_processes,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_process_start,
            initargs=(target,),
        )

    def submit(self, entries: Sequence[dict[str, str]]) -> Ahead:
        """Queues each entry's compile (in order: the first submitted start first)."""
        return Ahead([self._executor.submit(_compile, json.dumps(entry)) for entry in entries])

    def close(self) -> None:
        """No further compile starts; those under way end in their processes (not waited for)."""
        self._executor.shutdown(wait=False, cancel_futures=True)


def num_processes_for(num_entries: int) -> int:
    """One process per CPU this process may use but one (the engine's own thread keeps one), at most one per entry."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cpus - 1, num_entries))


def _process_start(target: Target) -> None:
    """A pool process: no GPU of its own, Triton compiling for the engine's target, at a lower CPU priority than the
    engine's (its load and its step thread, which compiles what nobody listed, are the start's critical path)."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    with contextlib.suppress(OSError):
        os.nice(NICENESS)
    logging.getLogger().setLevel(logging.WARNING)
    from triton.runtime import driver

    driver.set_active(target_driver(target))


def _compile(entry_json: str) -> float:
    """One entry compiled into Triton's file cache (read from it where there already); returns its seconds."""
    from services.worker.compile_manifest import kernel_of

    start = time.perf_counter()
    entry = json.loads(entry_json)
    fn = kernel_of(entry)
    if fn is None:
        raise LookupError(
            f"{entry.get('module')}.{entry.get('qualname')}: its kernel is gone or its parameters changed"
        )
    fn.preload(entry["specialization_data"])
    return time.perf_counter() - start
