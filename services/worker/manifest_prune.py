"""`shinkai cache prune`: the compile manifests (services/worker/compile_manifest.py) no start can load any more, and
those unused for a while, removed from ``<root>/variants``; the rest kept.

What goes, each with the reason it is listed with:

- **a manifest of other versions**: its ``key`` file (services/worker/manifest_key.py) names a Triton or torch other
  than this process's. Its key can never match again under these versions (the versions are hashed into it).
- **a manifest without a readable key file**: its versions are unknown (one written before manifests had it).
- **a manifest unused for ``older_than_s``** (optional): the newest time of its files, which each start that loads
  it refreshes (``CompileManifest.touch``) and each variant recorded into it sets, is older. This is how the manifests
  of a model config or engine shape no longer served go: nothing else tells a config no longer used.
- **an entry whose kernel is gone or whose parameters changed**, in a manifest that stays: each start would skip it.
- **a writer's leftover** (``tmp.*``: a directory being built, an entry being written) from a process that died.

Kept: manifests of the current versions for any device (a cache root shared by hosts with other GPUs serves them
too; ``older_than_s`` ages them out).

A running engine may write at the same time. Anything younger than ``grace_s`` (an hour) that is not a stale
manifest of other versions is left alone: a writer's temporary file or directory, a key file being written. A
manifest is removed by renaming it out of the way first (one atomic step), then deleting the renamed copy: an
engine recording into it meanwhile finds its directory gone and makes it again (``CompileManifest.add``), and an
entry it renames into place lands either in the manifest before it is renamed (and is removed with it) or in the new
one. Entries are removed one file at a time; one being written (a temporary) is never touched.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from services.cache_dirs import directory
from services.worker.compile_manifest import VARIANTS, kernel_of
from services.worker.manifest_key import KEY_FILE, versions

GRACE_S = 3600.0


@dataclass(frozen=True)
class Removed:
    """One thing ``prune`` removed (or, dry, would remove)."""

    path: Path  # the manifest directory, entry file or leftover
    why: str  # the reason, for the listing
    num_bytes: int  # bytes of its files


def prune(
    root: Path | None = None,
    older_than_s: float | None = None,
    dry_run: bool = False,
    grace_s: float = GRACE_S,
    current: Mapping[str, str] | None = None,
    now: float | None = None,
    environ: Mapping[str, str] = os.environ,
) -> list[Removed]:
    """Removes what the module docstring lists from ``root`` (default: the variants cache's directory) and returns it,
    in the order of their names. ``current``: the versions to keep (default: this process's); ``now``: the clock's
    time."""
    root = Path(root) if root is not None else directory(VARIANTS, environ)
    current = dict(current) if current is not None else versions()
    now = time.time() if now is None else now
    removed: list[Removed] = []
    try:
        children = sorted(root.iterdir())
    except FileNotFoundError:
        return removed
    for path in children:
        if path.name.startswith("tmp."):
            if now - _newest(path) > grace_s:
                removed.append(_remove(path, "a writer's leftover", dry_run, root))
            continue
        if not path.is_dir() or path.is_symlink():
            continue
        why = _stale_manifest(path, current, older_than_s, grace_s, now)
        if why is not None:
            removed.append(_remove(path, why, dry_run, root))
            continue
        removed += _prune_entries(path, grace_s, now, dry_run)
    return removed


def _stale_manifest(
    path: Path, current: Mapping[str, str], older_than_s: float | None, grace_s: float, now: float
) -> str | None:
    """Why the manifest at ``path`` goes whole, or None."""
    age = now - _newest(path)
    try:
        valid = json.loads((path / KEY_FILE).read_text())["valid"]
        built = {name: valid[name] for name in current}
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable key file: its versions are unknown" if age > grace_s else None
    if built != dict(current):
        return "built for " + ", ".join(f"{name} {version}" for name, version in built.items())
    if older_than_s is not None and age >= older_than_s:
        return f"unused for {age / 86400:.1f} days"
    return None


def _prune_entries(path: Path, grace_s: float, now: float, dry_run: bool) -> list[Removed]:
    """The entries of a manifest that stays whose kernel is gone or changed, and its writers' leftovers."""
    removed: list[Removed] = []
    try:
        files = sorted(path.iterdir())
    except OSError:  # removed meanwhile
        return removed
    for file in files:
        if file.name.startswith("tmp."):
            if now - _newest(file) > grace_s:
                removed.append(_remove(file, "a writer's leftover", dry_run))
            continue
        if file.suffix != ".json":
            continue
        try:
            entry = json.loads(file.read_text())
        except FileNotFoundError:  # removed meanwhile
            continue
        except (OSError, ValueError):
            removed.append(_remove(file, "unreadable", dry_run))
            continue
        if not isinstance(entry, dict) or kernel_of(entry) is None:
            removed.append(_remove(file, "its kernel is gone or its parameters changed", dry_run))
    return removed


def _newest(path: Path) -> float:
    """The newest modification time of ``path`` and the files directly in it (0 where it is gone)."""
    try:
        newest = path.stat().st_mtime
    except OSError:
        return 0.0
    try:
        children = list(os.scandir(path)) if path.is_dir() else []
    except OSError:  # removed meanwhile
        children = []
    for child in children:
        try:
            newest = max(newest, child.stat(follow_symlinks=False).st_mtime)
        except OSError:  # removed meanwhile
            pass
    return newest


def _size(path: Path) -> int:
    """Bytes of the files at or under ``path`` (those removed meanwhile not counted)."""
    total = 0
    for dirpath, _, filenames in os.walk(path) if path.is_dir() else [("", [], [str(path)])]:
        for name in filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _remove(path: Path, why: str, dry_run: bool, root: Path | None = None) -> Removed:
    """Removes ``path``; a directory is first renamed out of the way under ``root`` (module docstring)."""
    removed = Removed(path, why, _size(path))
    if dry_run:
        return removed
    if path.is_dir() and not path.is_symlink():
        target = Path(tempfile.mkdtemp(prefix="tmp.prune.", dir=root)) / path.name
        try:
            os.rename(path, target)
        except FileNotFoundError:  # removed meanwhile
            pass
        shutil.rmtree(target.parent, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
    return removed
