"""`shinkai cache compile`: every compile manifest under the cache root (services/worker/compile_manifest.py)
compiled into Triton's cache, for the GPU its key names, on this machine's CPUs: no GPU needed.

A new node given the manifests (``<root>/variants``, copied from a node that served the same models, or baked into
an image) but not their binaries starts "seeded": its precompile compiles every variant beside the weight load, in
processes (docs/serving.md, "Compiles in processes"). Compiled here first, on the node or in the image's build,
the start reads them from Triton's cache instead: a warm start. The variants compile in a ``CompilePool`` for the
target that the manifest's key file names (its device's compute capability; CUDA's warp of 32), so the binaries
are those the engine's own compile would write, under the same cache key (Triton's version and source, the ptxas
version, the options and the cache-relevant environment: run it with the engine's image and environment).

Skipped, each with the reason listed: a manifest without a readable key file, one of other Triton or torch versions
(the engine's key could never name it: ``shinkai cache prune`` removes those), and one whose device is not a CUDA
GPU (a CPU engine compiles nothing).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.cache_dirs import directory
from services.worker.compile_manifest import VARIANTS, CompileManifest
from services.worker.compile_pool import CompilePool, Target, num_processes_for
from services.worker.manifest_key import KEY_FILE, versions


@dataclass(frozen=True)
class ManifestCompiled:
    """What ``compile_manifests`` did with one manifest."""

    path: Path  # the manifest's directory
    target: Target | None  # what it compiled for; None: skipped
    num_entries: int  # its entries
    num_failed: int  # entries whose compile failed (their kernel gone or changed, or the compiler's error)
    seconds: float  # the compiles' own seconds, summed over the processes
    skipped: str | None = None  # why it was not compiled


def target_of(described: Mapping[str, object]) -> Target | None:
    """The target a manifest's key (``describe_key``'s JSON) names: its CUDA device's capability; None off CUDA."""
    validity = described.get("valid")
    if not isinstance(validity, Mapping):
        return None
    capability = validity.get("capability")
    if not str(validity.get("device", "")).startswith("cuda") or not isinstance(capability, list):
        return None
    major, minor = (int(c) for c in capability)
    return ("cuda", major * 10 + minor, 32)


def compile_manifests(
    root: Path | None = None,
    num_processes: int | None = None,
    progress: Callable[[Path, int, int], None] | None = None,
    environ: Mapping[str, str] = os.environ,
) -> list[ManifestCompiled]:
    """Every manifest under ``root`` (default: the cache root's ``variants``) compiled (module docstring), one
    manifest after another, each on a pool of ``num_processes`` (default: the CPUs but one); ``progress(manifest,
    done, total)`` as its compiles end."""
    root = root if root is not None else directory(VARIANTS, environ)
    current = versions()
    results = []
    found = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("tmp.")) if root.is_dir() else []
    for path in found:
        manifest = CompileManifest(path)
        entries = manifest.entries()
        try:
            described = json.loads((path / KEY_FILE).read_text())
        except (OSError, ValueError):
            results.append(ManifestCompiled(path, None, len(entries), 0, 0.0, "no readable key file"))
            continue
        validity = described.get("valid", {}) if isinstance(described, dict) else {}
        other = [f"{name} {validity.get(name)}" for name in current if validity.get(name) != current[name]]
        target = target_of(described) if isinstance(described, dict) else None
        if other:
            results.append(ManifestCompiled(path, None, len(entries), 0, 0.0, f"other versions ({', '.join(other)})"))
            continue
        if target is None:
            results.append(ManifestCompiled(path, None, len(entries), 0, 0.0, "not a CUDA device's"))
            continue
        pool = CompilePool(target, num_processes or num_processes_for(len(entries)))
        try:
            ahead = pool.submit(entries).wait(None if progress is None else lambda d, t: progress(path, d, t))
        finally:
            pool.close()
        results.append(ManifestCompiled(path, target, len(entries), ahead.num_failed, ahead.seconds))
    return results
