"""The kernel variants a process compiled, kept under the cache root so the next start compiles them all at once
before its graph capture and warm-up (on CUDA in processes first, services/worker/compile_pool.py, then read back
here on threads).

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
  the start goes on, and that launch compiles as it would have. Its parts can run apart: ``resolve()`` (the imports
  and Triton's per-device tables) on the thread that launches kernels, the compiles on another, which a ``stop``
  event ends early (services/engine/precompile.py runs them beside the weight load).

A manifest is one directory, ``<root>/variants/<key>`` (services/cache_dirs.py), per ``key``: a hash of what
picks the variants (the caller's description: the model's config and the engine's step shape) and of what makes a
compiled variant valid (the device's name and compute capability, Triton's and torch's versions). Its file ``key``
holds that description as JSON (``describe_key``), so ``shinkai cache prune`` can tell a manifest of other versions
without recomputing it (services/worker/manifest_prune.py); the directory appears whole with it (built under a
temporary name, then renamed into place), and ``precompile`` touches it, so its files' newest time is its last use.
The kernels' source is not in the key: after an upgrade that edits a kernel, its variants miss Triton's cache and
the manifest compiles them again in parallel. A variant no longer launched stays in the manifest and costs a compile
per start until ``shinkai cache prune`` (its kernel gone or changed) or ``shinkai cache clear --variants`` drops it.

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
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.cache_dirs import CACHES, directory
from services.worker.manifest_key import KEY_FILE, describe_key, key_of

log = logging.getLogger("shinkai.worker.compile_manifest")

VARIANTS = next(c for c in CACHES if c.name == "variants")
"""The manifests' cache (services/cache_dirs.py: ``<root>/variants``; `shinkai cache` shows and clears it)."""
ATTEMPTS = 5
"""Tries to write an entry whose directory a prune removes meanwhile, before giving it up (the hook logs it)."""
_RECORDING: dict = {}
"""While the process records: the manifest, Triton's hook set before, and the one ``record`` set."""


@dataclass(frozen=True)
class Precompiled:
    """What ``precompile`` did."""

    num_entries: int  # entries in the manifest
    num_preloaded: int  # variants compiled or read from Triton's cache, now in their kernel's in-process table
    num_stale: int  # entries skipped: kernel gone, parameters changed, the compile failed (or was cancelled by stop)
    seconds: float  # wall time of the whole pass


class CompileManifest:
    def __init__(self, directory: Path, described: str | None = None) -> None:
        self.directory = Path(directory)  # its entries, one file each
        self.described = described  # its key file's text (``describe_key``); None: it writes none

    @staticmethod
    def under_root(key: str, environ: Mapping[str, str] = os.environ) -> CompileManifest:
        """The manifest of ``key`` under the cache root (no key file: a test's)."""
        return CompileManifest(directory(VARIANTS, environ) / key)

    @staticmethod
    def described_under_root(
        description: Mapping[str, object], device: str, environ: Mapping[str, str] = os.environ
    ) -> CompileManifest:
        """The manifest of ``description`` on ``device`` (``manifest_key``) under the cache root, with its key file."""
        described = describe_key(description, device)
        return CompileManifest(directory(VARIANTS, environ) / key_of(described), described)

    def touch(self) -> None:
        """Marks the manifest used now (its key file's time, else its directory's), where it exists."""
        for path in (self.directory / KEY_FILE, self.directory):
            try:
                os.utime(path)
                return
            except OSError:
                continue

    def _make_directory(self) -> None:
        """The directory, appearing whole with its key file: built under a temporary name beside it, then renamed
        into place (where another process got there first, theirs stays)."""
        if self.directory.is_dir():
            return
        if self.described is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            return
        self.directory.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix="tmp.", dir=self.directory.parent))
        try:
            (building / KEY_FILE).write_text(self.described)
            os.rename(building, self.directory)
        except OSError:
            if not self.directory.is_dir():
                raise
        finally:
            shutil.rmtree(building, ignore_errors=True)

    # ---------------------------------------------------------------- recording

    def record(self) -> None:
        """From now on, every variant this process compiles is written here (module docstring), until
        ``stop_recording``. Replaces the manifest an earlier ``record`` set; a hook set before keeps being called,
        also one set over an earlier ``record``'s hook (recording then chains onto it)."""
        from triton import knobs

        if _RECORDING and knobs.runtime.jit_post_compile_hook is _RECORDING["hook"]:
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
        entry = json.dumps({"module": module, "qualname": qualname, "specialization_data": specialization_data})
        for attempt in range(ATTEMPTS):  # the directory pruned meanwhile (`shinkai cache prune`): made again
            self._make_directory()
            try:
                fd, tmp = tempfile.mkstemp(prefix="tmp.", dir=self.directory)
                try:
                    with os.fdopen(fd, "w") as f:
                        f.write(entry)
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
                return path
            except OSError:  # its directory gone (or, made by another writer, gone again); a full disk
                if attempt == ATTEMPTS - 1:
                    raise
        raise AssertionError

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

    def resolve(self) -> Resolved:
        """Every entry's kernel, found by module and name (importing its module), with its per-device table made:
        the part of ``precompile`` to run on the thread that launches kernels, before the compiles go to others
        (imports and the tables are not made concurrently with that thread's own)."""
        from triton.runtime import driver

        entries = self.entries()
        found = []
        for entry in entries:
            fn = kernel_of(entry)
            if fn is None:
                name = f"{entry.get('module')}.{entry.get('qualname')}"
                log.info("compile manifest: skipped %s (its kernel is gone or its parameters changed)", name)
                continue
            try:
                fn.device_caches[driver.active.get_current_device()]  # Triton's per-device table, made here
            except Exception as e:  # no driver: nothing can compile
                log.warning("compile manifest: no device to compile for (%s)", e)
                return Resolved(len(entries), [])
            found.append((fn, entry["specialization_data"]))
        return Resolved(len(entries), found)

    def precompile(
        self,
        workers: int | None = None,
        progress: Callable[[int, int], None] | None = None,
        resolved: Resolved | None = None,
        thread_setup: Callable[[], None] | None = None,
        stop: threading.Event | None = None,
    ) -> Precompiled:
        """Compiles every entry's variant at once in ``workers`` threads (module docstring); ``progress(done,
        total)`` after each one ends. Call it before the launches that need them (graph capture, warm-up).
        ``resolved``: ``resolve()``'s, done earlier on the launching thread (else done here); ``thread_setup``: run
        first on each worker thread; ``stop`` set: no further compile starts (those under way end)."""
        import time

        from triton.runtime._async_compile import AsyncCompileMode

        start = time.perf_counter()
        self.touch()
        resolved = resolved if resolved is not None else self.resolve()
        num_unresolved = resolved.num_entries - len(resolved.kernels)
        submitted: list[concurrent.futures.Future] = []
        executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers or _num_cpus(), thread_name_prefix="precompile", initializer=thread_setup
        )
        num_failed = 0
        with executor, AsyncCompileMode(executor, ignore_errors=True) as mode:
            for fn, data in resolved.kernels:
                if stop is not None and stop.is_set():
                    break
                before = len(mode.raw_futures)
                try:
                    fn.preload(data)
                except Exception as e:  # an entry of another Triton's options …
                    num_unresolved += 1
                    log.info("compile manifest: skipped a variant of %s (%s)", fn, e)
                    continue
                # One future per compile (none where an earlier entry's compile was the same source and options).
                submitted += mode.raw_futures[before:]
            if stop is not None and stop.is_set():
                executor.shutdown(wait=False, cancel_futures=True)
            for done, future in enumerate(concurrent.futures.as_completed(submitted), 1):
                if future.cancelled() or future.exception() is not None:
                    num_failed += 1
                    if not future.cancelled():
                        log.warning("compile manifest: a variant failed to compile (%s)", future.exception())
                if progress is not None:
                    progress(done, len(submitted))
        num_preloaded = len(submitted) - num_failed
        return Precompiled(
            resolved.num_entries, num_preloaded, num_unresolved + num_failed, time.perf_counter() - start
        )


@dataclass(frozen=True)
class Resolved:
    """A manifest's entries with their kernels found (``CompileManifest.resolve``)."""

    num_entries: int  # entries in the manifest
    kernels: list  # (the kernel's JITFunction, the entry's specialization_data) of each entry whose kernel was found


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


def kernel_of(entry: Mapping[str, str]):
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
