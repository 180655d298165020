"""Load a checkpoint directory straight into the kernel backend's device form (the GPU loader).

The released tensors (spec §3.11: FP8 with 32×32 e8m0 scales, MXFP4 experts, FP8 row-wise Engram
tables, bf16/fp32) are read one part at a time — embed, norm, head, each layer, then the DSpark draft
(``mtp.*``, part of ``checkpoint.stored_table`` when the config has draft stages) — through
``safetensors.safe_open`` memory maps, moved to the device, placed and converted there by
``build_kernel_model`` (services/worker/kernel_model/gpu_model.py, the same code the random v41-s1 build runs), and
dropped before the next part. The whole model never exists in fp32, nor on the host.

Invariants:
- Every stored tensor is checked against ``checkpoint.stored_table(config)`` from the file headers
  before any tensor data is read: a missing, unexpected, misshaped or mistyped tensor raises
  ``CheckpointError`` naming the tensor and its file. Damaged files (bad header, offsets out of range,
  truncation, a shard named in the index but absent) fail at the same point, naming the file.
- Host memory holds at most one part's mapped pages plus one band of ``BAND_BYTES`` (a tensor larger
  than a band, an Engram table, is copied band by band); each part's files are unmapped after it.
- Device memory peaks at the converted model plus one part in its released and fp32 forms.
"""

from __future__ import annotations

import contextlib
import logging
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from model.deepseek_v41.checkpoint import stored_table
from model.deepseek_v41.config import ModelConfig, load_config
from model.deepseek_v41.safetensors_io import CheckpointError, checkpoint_files
from model.deepseek_v41.tokenizer import engram_token_map, load_tokenizer
from services.worker import startup

log = logging.getLogger(__name__)

BAND_BYTES = 1 << 30
"""A tensor above this many bytes is copied to the device in row bands of at most this size."""

SAFETENSORS_DTYPES = {
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.int8: "I8",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
}
"""The safetensors header's dtype string of every dtype the released table stores."""


@dataclass
class LoadReport:
    """What one load read and how long it took."""

    num_bytes: int  # stored bytes read from the checkpoint (every tensor, scales included)
    seconds: float  # wall time from the header checks to the last converted layer
    peak_host_bytes: int  # the process's peak resident set size (ru_maxrss) at the end
    peak_device_bytes: int | None  # torch.cuda.max_memory_allocated at the end; None off CUDA
    num_parts: int  # embed, norm, head, the layers, the draft and the vision tower's parts
    num_inexact: int  # FP8 weight elements not exact in e4m3 at 128×128 scales (rounded; kernels/fp8_weights.py)

    @property
    def gb_per_s(self) -> float:
        return self.num_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def describe(self) -> str:
        device = "" if self.peak_device_bytes is None else f", peak GPU {self.peak_device_bytes / 2**30:.1f} GiB"
        return (
            f"loaded {self.num_bytes / 1e9:.2f} GB in {self.seconds:.1f} s ({self.gb_per_s:.2f} GB/s), "
            f"peak host RSS {self.peak_host_bytes / 2**30:.1f} GiB{device}; {self.num_inexact} FP8 weight "
            "elements not exact at 128×128"
        )


class CheckpointReader:
    """The tensors of one checkpoint (a file, ``model.safetensors``, or shards with an index JSON), checked
    against ``cfg``'s table from their headers at construction, then read a prefix at a time."""

    def __init__(self, path: str | Path, cfg: ModelConfig) -> None:
        self.path = Path(path)
        self.files = checkpoint_files(self.path)  # name → file; opens every header (damage fails here)
        self.table = stored_table(cfg)
        self._check_table()
        self.num_bytes = sum(torch.Size(shape).numel() * dtype.itemsize for shape, dtype in self.table.values())

    def _check_table(self) -> None:
        missing = [name for name in self.table if name not in self.files]
        if missing:
            raise CheckpointError(
                f"{self.path}: checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}"
            )
        extra = sorted(set(self.files) - set(self.table))
        if extra:
            raise CheckpointError(
                f"{self.files[extra[0]]}: {len(extra)} unexpected tensor(s) for this config: {', '.join(extra[:5])}"
            )
        for file, names in self._by_file(list(self.table)).items():
            try:
                with safe_open(str(file), framework="pt") as f:
                    for name in names:
                        part = f.get_slice(name)
                        shape, dtype = self.table[name]
                        if tuple(part.get_shape()) != shape:
                            raise CheckpointError(
                                f"{file}: tensor {name} has shape {list(part.get_shape())}, expected {list(shape)}"
                            )
                        if part.get_dtype() != SAFETENSORS_DTYPES[dtype]:
                            raise CheckpointError(
                                f"{file}: tensor {name} has dtype {part.get_dtype()}, expected "
                                f"{SAFETENSORS_DTYPES[dtype]} ({dtype})"
                            )
            except (SafetensorError, OSError) as e:
                raise CheckpointError(f"{file}: unreadable ({e})") from e

    def _by_file(self, names: list[str]) -> dict[Path, list[str]]:
        out: dict[Path, list[str]] = {}
        for name in names:
            out.setdefault(self.files[name], []).append(name)
        return out

    def read(self, prefix: str, device: torch.device | str, on_host=None) -> dict[str, torch.Tensor]:
        """Every stored tensor whose name starts with ``prefix``, on ``device`` with its stored dtype (on the host
        instead where ``on_host(name)``: the device never sees those bytes)."""
        device = torch.device(device)
        names = [name for name in self.table if name.startswith(prefix)]
        out: dict[str, torch.Tensor] = {}
        for file, file_names in self._by_file(names).items():
            try:
                with safe_open(str(file), framework="pt") as f:  # unmapped when the block ends
                    for name in file_names:
                        where = torch.device("cpu") if on_host is not None and on_host(name) else device
                        out[name] = _copy(f, name, self.table[name], where)
            except (SafetensorError, OSError, RuntimeError) as e:
                raise CheckpointError(f"{file}: reading tensor failed ({e})") from e
        return out


def _copy(f, name: str, stored: tuple[tuple[int, ...], torch.dtype], device: torch.device) -> torch.Tensor:
    """One tensor to ``device``; above BAND_BYTES row band by row band, so the host holds one band."""
    shape, dtype = stored
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes <= BAND_BYTES or len(shape) < 2:
        return f.get_tensor(name).to(device)
    out = torch.empty(shape, dtype=dtype, device=device)
    rows = max(1, BAND_BYTES // (nbytes // shape[0]))
    part = f.get_slice(name)
    for r in range(0, shape[0], rows):
        out[r : r + rows].copy_(part[r : r + rows])
    return out


def check_checkpoint(path: str | Path) -> CheckpointReader:
    """Check a checkpoint directory's config and every tensor header against its table, reading no tensor
    data (seconds even for a large model); raises CheckpointError naming the file and tensor."""
    try:
        cfg = load_config(path)
    except (FileNotFoundError, ValueError) as e:
        raise CheckpointError(f"{path}: {e}") from e
    return CheckpointReader(path, cfg)


@contextlib.contextmanager
def _progress(total: int, desc: str) -> Iterator:
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="part", mininterval=1.0)
    try:
        yield bar
    finally:
        bar.close()


def load_kernel_model(
    path: str | Path,
    device: torch.device | str,
    precision: str = "fp8",
    kernels=None,
    convert: bool = True,
    expert_format: str = "fp8",
    engram_on_host: bool = False,
):
    """(model, tokenizer, report): the checkpoint directory ``path`` loaded into the kernel backend's
    form on ``device`` (``convert=False``: placed but not converted, for tests); routed experts in
    ``expert_format``; with ``engram_on_host`` the Engram tables are read straight to the host."""
    from services.worker.kernel_model.gpu_model import build_kernel_model, is_engram_table
    from services.worker.kernel_model.gpu_model import num_parts as count_parts

    path = Path(path)
    device = torch.device(device)
    start = time.perf_counter()
    cfg = load_config(path)
    tokenizer = load_tokenizer(path)
    token_map = num_compressed = None
    if cfg.engram_layer_ids:
        token_map, num_compressed = engram_token_map(tokenizer)
        token_map = torch.as_tensor(token_map)
    reader = CheckpointReader(path, cfg)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    num_parts = count_parts(cfg)
    inexact = [0]

    def placed(prefix: str, conversion) -> None:
        bar.update(1)
        step.advance(prefix.rstrip("."))  # the startup phase's count (services/worker/startup.py)
        inexact[0] += getattr(conversion, "inexact", 0)

    with _progress(num_parts, f"load {path.name}") as bar, startup.phase("loading", total=num_parts) as step:
        model = build_kernel_model(
            cfg,
            lambda prefix: reader.read(prefix, device, is_engram_table if engram_on_host else None),
            device,
            precision,
            token_map,
            num_compressed,
            kernels,
            convert,
            on_part=placed,
            expert_format=expert_format,
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report = LoadReport(
        reader.num_bytes,
        time.perf_counter() - start,
        resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        num_parts,
        inexact[0],
    )
    log.info("%s: %s", path, report.describe())
    return model, tokenizer, report
