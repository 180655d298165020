"""Safetensors checkpoints: single file or sharded, with errors that name the file and the problem.

The ``safetensors`` library does the parsing and validation (header length, JSON, dtypes, that the
data offsets tile the file exactly); this module resolves checkpoint directories, reads sharded
``model.safetensors.index.json`` checkpoints, and turns every failure into a ``CheckpointError``.
Bit flips inside tensor data cannot be detected: the format has no checksum.

Layouts accepted by ``checkpoint_files`` / ``read_checkpoint``:
- a ``.safetensors`` file;
- a directory with ``model.safetensors``;
- a directory with ``model.safetensors.index.json`` (``{"metadata": …, "weight_map": {name: shard}}``),
  whose shards must hold exactly the names the index gives them.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_HINTS = {
    "header too small": "file too short to be safetensors (empty or truncated)",
    "invalid header length": "header length field is invalid (truncated or not a safetensors file)",
    "header too large": "header length field is too large (corrupt or not a safetensors file)",
    "file not fully covered": "file size does not match its header (truncated, or trailing bytes)",
    "invalid JSON": "corrupt header (invalid JSON)",
    "invalid shape, data type, or offset": "corrupt header (a tensor's shape, dtype and offsets disagree)",
}


class CheckpointError(ValueError):
    """A checkpoint file or directory cannot be read; the message names the path and the problem."""


_ITEM_BYTES = {
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "BF16": 2,
    "F16": 2,
    "I16": 2,
    "F32": 4,
    "I32": 4,
    "F64": 8,
    "I64": 8,
}


def _bad_tensor(path: Path) -> str | None:
    """The first tensor whose header entry cannot be right (offsets that disagree with its shape and dtype,
    or that run past the file), to name it in the error; None when none can be named. Diagnosis only:
    safetensors has already refused the file."""
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length)) if 0 < length < 100_000_000 else None
        data_bytes = path.stat().st_size - 8 - length
    except (OSError, ValueError):
        return None
    if not isinstance(header, dict):
        return None
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        try:
            begin, end = entry["data_offsets"]
            numel = 1
            for d in entry["shape"]:
                numel *= d
            expected = numel * _ITEM_BYTES.get(entry["dtype"], 0)
        except (KeyError, TypeError, ValueError):
            return f"tensor {name}: malformed header entry"
        if end - begin != expected:
            return (
                f"tensor {name}: offsets [{begin}, {end}) hold {end - begin} bytes, its shape and dtype need {expected}"
            )
        if end > data_bytes:
            return f"tensor {name}: offsets [{begin}, {end}) run past the {data_bytes} data bytes in the file"
    return None


def _rephrase(path: Path, error: Exception) -> CheckpointError:
    text = str(error)
    hint = next((h for k, h in _HINTS.items() if k in text), "unreadable safetensors file")
    bad = _bad_tensor(path)
    if bad is not None:
        hint = f"{hint}; {bad}"
    try:
        size = f"{path.stat().st_size} bytes"
    except OSError:
        size = "size unknown"
    return CheckpointError(f"{path}: {hint} ({size}; safetensors: {text})")


def tensor_names(file: str | os.PathLike[str]) -> list[str]:
    """Names in one safetensors file, reading only its header."""
    path = Path(file)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError, ValueError) as e:
        raise _rephrase(path, e) from e


def read_metadata(file: str | os.PathLike[str]) -> dict[str, str]:
    """The free-form ``__metadata__`` of one file ({} when absent)."""
    path = Path(file)
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except (SafetensorError, OSError, ValueError) as e:
        raise _rephrase(path, e) from e


def read_safetensors(file: str | os.PathLike[str], names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of one file (all, or ``names``), as CPU tensors with their stored dtypes."""
    path = Path(file)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            wanted = list(f.keys()) if names is None else list(names)
            missing = sorted(set(wanted) - set(f.keys()))
            if missing:
                raise CheckpointError(f"{path}: missing tensor(s) {', '.join(missing[:5])}")
            return {name: f.get_tensor(name) for name in wanted}
    except (SafetensorError, OSError) as e:
        raise _rephrase(path, e) from e


def _read_index(index: Path) -> dict[str, Path]:
    try:
        document = json.loads(index.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{index}: unreadable index ({e})") from e
    weight_map = document.get("weight_map") if isinstance(document, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index}: no 'weight_map' object mapping tensor names to shard files")
    shards: dict[str, Path] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard:
            raise CheckpointError(f"{index}: tensor {name!r} maps to {shard!r}, not a file name in this directory")
        shards[name] = index.parent / shard
    return shards


def checkpoint_files(path: str | os.PathLike[str]) -> dict[str, Path]:
    """Map every tensor name to the file holding it, reading headers only.

    Raises ``CheckpointError`` for a missing path, a directory with neither layout, an index whose
    shards are missing or disagree with it, and a name stored twice.
    """
    p = Path(path)
    if p.is_file():
        return {name: p for name in tensor_names(p)}
    if not p.is_dir():
        raise CheckpointError(f"{p}: no such file or directory")
    if (p / SINGLE_FILE).is_file():
        return {name: p / SINGLE_FILE for name in tensor_names(p / SINGLE_FILE)}
    if not (p / INDEX_FILE).is_file():
        raise CheckpointError(f"{p}: directory has neither {SINGLE_FILE} nor {INDEX_FILE}")
    expected = _read_index(p / INDEX_FILE)
    found: dict[str, Path] = {}
    for shard in sorted(set(expected.values())):
        if not shard.is_file():
            raise CheckpointError(f"{p / INDEX_FILE}: shard {shard.name} is missing")
        for name in tensor_names(shard):
            if name in found:
                raise CheckpointError(f"{shard}: tensor {name!r} is also stored in {found[name].name}")
            if expected.get(name) != shard:
                raise CheckpointError(f"{shard}: tensor {name!r} is not assigned to this shard by {INDEX_FILE}")
            found[name] = shard
    absent = sorted(set(expected) - set(found))
    if absent:
        raise CheckpointError(
            f"{p / INDEX_FILE}: tensor {absent[0]!r} is missing from shard {expected[absent[0]].name}"
        )
    return found


def read_checkpoint(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """All tensors of a file, a ``model.safetensors`` directory or a sharded directory."""
    by_file: dict[Path, list[str]] = {}
    for name, file in checkpoint_files(path).items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for file, names in by_file.items():
        tensors.update(read_safetensors(file, names))
    return tensors


def _storable(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous CPU tensors with no shared storage (safetensors refuses aliases)."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        t = t.detach().to("cpu")
        if not t.is_contiguous() or t.untyped_storage().data_ptr() in seen:
            t = t.contiguous().clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], file: str | os.PathLike[str], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write one file atomically (temp file in the same directory, then rename)."""
    path = Path(file)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(_storable(tensors), tmp, metadata=dict(metadata or {"format": "pt"}))
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; checkpoints are read by other users (containers)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_checkpoint(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``model.safetensors``, or shards plus ``model.safetensors.index.json`` when the tensors
    exceed ``max_shard_bytes`` (None: never shard). Shards are filled in the given order."""
    out = Path(out_dir)
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and groups[-1] and size + nbytes > max_shard_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    if len(groups) == 1:
        return [write_safetensors(groups[0], out / SINGLE_FILE, metadata)]
    written, weight_map = [], {}
    for i, group in enumerate(groups, start=1):
        shard = out / f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        written.append(write_safetensors(group, shard, metadata))
        weight_map.update({name: shard.name for name in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    return written + [write_index(out, weight_map, total)]


def write_index(out_dir: str | os.PathLike[str], weight_map: Mapping[str, str], total_size: int) -> Path:
    """Write ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``) atomically."""
    index = {"metadata": {"total_size": total_size}, "weight_map": dict(weight_map)}
    index_path = Path(out_dir) / INDEX_FILE
    tmp = index_path.with_name(f".{INDEX_FILE}.tmp")
    tmp.write_text(json.dumps(index, indent=2))
    os.replace(tmp, index_path)
    return index_path
