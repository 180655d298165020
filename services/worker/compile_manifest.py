"""The kernel variants a process compiled, kept under the cache root so the next start compiles them all at once,
in a thread pool, before its graph capture and warm-up.

Triton compiles a variant (a kernel's specialisation key: docs/kernel-notes.md, "Variants") the first time a launch
needs it, on the launching thread, one after another. A manifest names every variant a process compiled, so a later
start can compile the same set in parallel before any step runs:

- **Recording.** ``record()`` sets Triton's ``knobs.runtime.jit_post_compile_hook`` (chaining any hook set before),
  which Triton calls after each compile with the variant's ``specialization_data``: its own JSON of the signature,
  the constexprs, the alignment attributes, the options and the launch's cache key. Each variant becomes one file,
  named by a hash of its kernel and key, written into a private temporary file and ``os.replace``-d into place:
  processes writing at once (two engines on one host) never leave a partial entry, and the same variant from two
  of them is the same bytes.
- **Precompiling.** ``precompile()`` reads every entry, finds its kernel by module and qualified name, and calls
  Triton's ``JITFunction.preload`` under Triton's ``AsyncCompileMode`` over a thread pool of ``workers`` (default:
  the CPUs the process may use): each variant is compiled in a worker thread (ptxas, most of a compile's time, is a
  subprocess, outside the GIL), or read from Triton's file cache where it holds it, and lands in the kernel's
  in-process table under the launch's key, so the launch that needs it finds it without a compile. An entry whose
  kernel is gone, whose parameters changed or whose compile fails is skipped and counted (``Precompiled.num_stale``);
  the start goes on, and that launch compiles as it would have.

A manifest is one directory, ``<root>/variants/<key>`` (services/cache_dirs.py), per ``key``: a hash of what
picks the variants (the caller's description: the model's config and the engine's step shape) and of what makes a
compiled variant valid (the device's name and compute capability, Triton's and torch's versions). The kernels'
source is not in the key: after an upgrade that edits a kernel, its variants miss Triton's cache and the manifest
compiles them again in parallel. A variant no longer launched stays in the manifest and costs a compile per start
until ``shinkai cache clear --variants`` (or a new key) drops it.

What a manifest cannot do: the first start on an empty cache root has none, so its variants compile one at a time
as the build and the warm-up launch them.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import importlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.cache_dirs import CACHES, directory

log = logging.getLogger("shinkai.worker.compile_manifest")

VARIANTS = next(c for c in CACHES if c.name == "variants")
"""The manifests' cache (services/cache_dirs.py: ``<root>/variants``; `shinkai cache` shows and clears it)."""
_RECORDING: dict = {}
"""While the process records: the manifest, Triton's hook set before, and the one ``record`` set."""


@dataclass(frozen=True)
class Precompiled:
    """What ``precompile`` did."""

    num_entries: int  # entries in the manifest
    num_preloaded: int  # variants compiled or read from Triton's cache, now in their kernel's in-process table
    num_stale: int  # entries skipped: kernel gone, parameters changed, or the compile failed
    seconds: float  # wall time of the whole pass


def manifest_key(description: Mapping[str, object], device: str) -> str:
    """The manifest's key: a hash of ``description`` (what picks the variants; JSON-able, any value else by ``str``)
    with the device's name and capability (on CUDA) and Triton's and torch's versions."""
    import torch
    import triton

    validity: dict[str, object] = {"triton": triton.__version__, "torch": torch.__version__, "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        validity["device_name"] = torch.cuda.get_device_name(index)
        validity["capability"] = list(torch.cuda.get_device_capability(index))
    text = json.dumps({"picks": description, "valid": validity}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


class CompileManifest:
    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)

    @staticmethod
    def under_root(key: str, environ: Mapping[str, str] = os.environ) -> CompileManifest:
        """The manifest of ``key`` (``manifest_key``) under the cache root."""
        return CompileManifest(directory(VARIANTS, environ) / key)

    # ---------------------------------------------------------------- recording

    def record(self) -> None:
        """From now on, every variant this process compiles is written here (module docstring), until
        ``stop_recording``. Replaces the manifest an earlier ``record`` set; a hook set before keeps being called."""
        from triton import knobs

        if _RECORDING:
            _RECORDING["manifest"] = self
            return
        previous = knobs.runtime.jit_post_compile_hook

        def compiled(**kwargs: object) -> object:
            try:
                fn, job = kwargs["fn"], kwargs["compile"]  # Triton's JitFunctionInfo; the compile's arguments
                _RECORDING["manifest"].add(fn.module, fn.name, job["specialization_data"], job["key"])
            except Exception as e:  # never fails the compile: a full disk costs only the next start's precompile
                log.warning("compile manifest: could not record a variant (%s)", e)
            return previous(**kwargs) if previous is not None else None

        _RECORDING.update(manifest=self, previous=previous, hook=compiled)
        knobs.runtime.jit_post_compile_hook = compiled

    def add(self, module: str, qualname: str, specialization_data: str, key: str) -> Path:
        """Writes one variant's entry (whole or not at all); returns its file."""
        name = hashlib.sha256(f"{module}:{qualname}:{key}".encode()).hexdigest()[:40]
        path = self.directory / f"{name}.json"
        if path.exists():
            return path
        self.directory.mkdir(parents=True, exist_ok=True)
        entry = {"module": module, "qualname": qualname, "specialization_data": specialization_data}
        fd, tmp = tempfile.mkstemp(prefix="tmp.", dir=self.directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(entry, f)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path

    # ---------------------------------------------------------------- reading and precompiling

    def entries(self) -> list[dict[str, str]]:
        """Every whole entry (a writer's temporary file is not one)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in sorted(self.directory.glob("*.json")):
            try:
                entry = json.loads(path.read_text())
                if not isinstance(entry, dict):
                    raise ValueError("not an entry")
                found.append(entry)
            except (OSError, ValueError) as e:
                log.warning("compile manifest: skipped %s (%s)", path.name, e)
        return found

    def precompile(self, workers: int | None = None, progress: Callable[[int, int], None] | None = None) -> Precompiled:
        """Compiles every entry's variant at once in ``workers`` threads (module docstring); ``progress(done,
        total)`` after each one ends. Call it before the launches that need them (graph capture, warm-up)."""
        import time

        from triton.runtime._async_compile import AsyncCompileMode

        start = time.perf_counter()
        entries = self.entries()
        num_unresolved = 0
        submitted: list[concurrent.futures.Future] = []
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=workers or _num_cpus())
        with executor, AsyncCompileMode(executor, ignore_errors=True) as mode:
            for entry in entries:
                before = len(mode.raw_futures)
                try:
                    fn = _kernel(entry)
                    if fn is None:
                        raise LookupError("its kernel is gone or its parameters changed")
                    fn.preload(entry["specialization_data"])
                except Exception as e:  # an entry of another Triton's options, a renamed kernel …
                    num_unresolved += 1
                    log.info("compile manifest: skipped %s.%s (%s)", entry.get("module"), entry.get("qualname"), e)
                    continue
                # One future per compile (none where an earlier entry's compile was the same source and options).
                submitted += mode.raw_futures[before:]
            num_failed = 0
            for done, future in enumerate(concurrent.futures.as_completed(submitted), 1):
                if future.exception() is not None:
                    num_failed += 1
                    log.warning("compile manifest: a variant failed to compile (%s)", future.exception())
                if progress is not None:
                    progress(done, len(submitted))
        return Precompiled(
            len(entries), len(submitted) - num_failed, num_unresolved + num_failed, time.perf_counter() - start
        )


def recording() -> CompileManifest | None:
    """The manifest this process records into, or None."""
    return _RECORDING.get("manifest")


def stop_recording() -> None:
    """Ends ``record``: Triton's hook is the one set before it again (where nothing replaced ``record``'s since)."""
    from triton import knobs

    if _RECORDING:
        if knobs.runtime.jit_post_compile_hook is _RECORDING["hook"]:
            knobs.runtime.jit_post_compile_hook = _RECORDING["previous"]
        _RECORDING.clear()


def _num_cpus() -> int:
    """The CPUs this process may run on (a container's or ``taskset``'s set, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _kernel(entry: Mapping[str, str]):
    """The entry's ``JITFunction`` (through an autotuner's or heuristics' ``fn``), or None where the module, the name
    or the parameters no longer match."""
    from triton.runtime.jit import JITFunction

    try:
        obj: object = importlib.import_module(entry["module"])
        for part in entry["qualname"].split("."):
            obj = getattr(obj, part)
        while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):
            obj = obj.fn
        data = json.loads(entry["specialization_data"])
    except (ImportError, AttributeError, KeyError, ValueError):
        return None
    if not isinstance(obj, JITFunction) or list(data.get("signature", {})) != obj.arg_names:
        return None
    return obj
