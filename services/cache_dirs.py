"""The compile caches of every process that compiles kernels, kept under one root so a restart skips the compiles.

``setup()`` runs once at the start of each such process (the `shinkai` command line, so `generate`, `serve`, `up`
and `bench`; `up`'s children inherit its environment; the engine and worker processes; `python -m
services.bench.step.run`) before anything compiles. For each cache it sets the library's own variable to
``<root>/<cache>`` (the root: model/cache_root.py, ``~/.cache/shinkai`` by default) unless the variable is set
already: a directory the user chose is never overridden.

- ``triton`` (``TRITON_CACHE_DIR``): each compiled kernel variant (TTIR … PTX, cubin, metadata), keyed by Triton's
  hash of the source, Triton's version, the target (arch, ptxas), the options and the variables that change code.
- ``inductor`` (``TORCHINDUCTOR_CACHE_DIR``): ``torch.compile``'s graphs and kernels (the step benchmark's
  comparison), keyed by inductor's hashes, which include torch's version and the device.
- ``deepgemm`` (``DG_JIT_CACHE_DIR``): DeepGEMM's JIT-compiled cubins, keyed by DeepGEMM's hash of the kernel's
  name, the compiler's version, its flags (the arch) and the code with its headers.
- ``tokenizer`` (no variable): the patched V4.1 ``tokenizer.json``, keyed by the source's content hash.
- ``variants`` (no variable): compile manifests, the kernel variants an engine compiled, which the next start with
  the same key compiles at once in a thread pool (services/worker/compile_manifest.py); an entry is one manifest,
  keyed by the model's config, the engine's step shape, the device and Triton's and torch's versions.

Every library keys its entries by versions and device itself, so one directory serves any mix of them without a
collision, and each writes an entry whole before it can be read: Triton writes every file into a private temporary
directory and ``os.replace``-s it into place, the group file listing the others last; DeepGEMM renames a whole
kernel directory into place. Two processes compiling the same kernel at once both compile it; the later rename
wins with identical bytes (tests/services/test_cache_dirs.py runs two processes on one directory).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

from model.cache_root import cache_root


@dataclass(frozen=True)
class Cache:
    name: str  # as `shinkai cache` names it (and its --flag)
    env: str | None  # the library's variable for its directory; None: only the project writes it
    subdir: str  # its directory under the root, where the variable is not set
    entries_under: str  # where its entries are, relative to its directory ("": the directory itself)


CACHES = (
    Cache("triton", "TRITON_CACHE_DIR", "triton", ""),
    Cache("inductor", "TORCHINDUCTOR_CACHE_DIR", "inductor", ""),
    Cache("deepgemm", "DG_JIT_CACHE_DIR", "deepgemm", "cache"),
    Cache("tokenizer", None, "tokenizer", ""),
    Cache("variants", None, "variants", ""),
)


def directory(cache: Cache, environ: Mapping[str, str] = os.environ) -> Path:
    """The directory ``cache`` uses in a process with ``environ``: the variable's, else its place under the root."""
    if cache.env is not None and environ.get(cache.env):
        return Path(environ[cache.env]).expanduser()
    return cache_root(environ) / cache.subdir


def setup(environ: MutableMapping[str, str] = os.environ) -> dict[str, Path]:
    """Each library's variable set to its directory under the root, where it is unset; returns every cache's
    directory. Directories are created by the libraries when they first write."""
    for cache in CACHES:
        if cache.env is not None and not environ.get(cache.env):
            environ[cache.env] = str(cache_root(environ) / cache.subdir)
    return {cache.name: directory(cache, environ) for cache in CACHES}


@dataclass(frozen=True)
class Usage:
    name: str  # the cache's name
    path: Path  # its directory
    num_bytes: int  # bytes of its files (0 where it does not exist)
    num_entries: int  # compiled entries: kernel variants, graphs, tokenizer files (0 where it does not exist)


def _is_temporary(path: Path) -> bool:
    """A writer's work in progress (Triton's ``tmp.pid_*``, DeepGEMM's ``tmp``), not an entry."""
    return path.name == "tmp" or path.name.startswith("tmp.") or path.name == "lock"


def usage(cache: Cache, environ: Mapping[str, str] = os.environ) -> Usage:
    path = directory(cache, environ)
    num_bytes = 0
    for dirpath, _, filenames in os.walk(path):
        for filename in filenames:
            try:
                num_bytes += os.lstat(os.path.join(dirpath, filename)).st_size
            except OSError:  # removed meanwhile by a concurrent writer's rename or a clear
                pass
    under = path / cache.entries_under
    try:
        num_entries = sum(1 for entry in under.iterdir() if not _is_temporary(entry))
    except OSError:
        num_entries = 0
    return Usage(cache.name, path, num_bytes, num_entries)


def _refuse_clearing(path: Path, environ: Mapping[str, str]) -> str | None:
    """Why ``path`` is no cache to empty (the home directory, a filesystem root, the cache root itself), or None."""
    resolved = path.resolve()
    if resolved == Path(resolved.anchor) or resolved == Path.home().resolve():
        return f"{path} is not a cache directory"
    if resolved == cache_root(environ).resolve():
        return f"{path} is the root of every Shinkai cache, not one cache"
    return None


def clear(cache: Cache, environ: Mapping[str, str] = os.environ) -> Usage:
    """Empties ``cache``'s directory (the directory stays); returns what it held. A process compiling meanwhile
    finds its entries gone and compiles them again."""
    why = _refuse_clearing(directory(cache, environ), environ)
    if why is not None:
        raise ValueError(f"not clearing the {cache.name} cache: {why}")
    before = usage(cache, environ)
    if before.path.is_dir():
        for entry in before.path.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
    return before
