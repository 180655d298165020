"""Random checkpoints in the released formats: ``config.json``, tokenizer files, ``model.safetensors``.

Weights are drawn per released tensor, scaled like the oracle script (spec §5.4) so that softmaxes,
the router, the sinks, the hyper-connection mixes and the Engram gates are far from uniform:
fan-in scaled matrices, norm gains and Engram q/k weights 1 ± 0.2, unit-variance sinks and Engram
rows, hc bases 0.5·N(0,1), router biases 0.3·N(0,1). Then each tensor is stored in its released
format (FP8 32×32 blocks, MXFP4 experts, FP8 row-wise Engram tables, BF16, FP32).
"""

from __future__ import annotations

import json
import math
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from model.deepseek_v41.checkpoint import TensorSpec, tensor_table
from model.deepseek_v41.config import ModelConfig, to_hf_dict
from model.deepseek_v41.presets import GPU_ONLY, preset
from model.deepseek_v41.quant import quantize_weight
from model.deepseek_v41.safetensors_io import write_checkpoint
from model.deepseek_v41.tokenizer import write_tokenizer_files


def random_value(spec: TensorSpec, generator: torch.Generator, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """One fp32 tensor of ``spec.shape`` (or of ``shape``, a band of its rows) drawn by the rule for its
    name, on the generator's device."""
    name = spec.name
    shape = spec.shape if shape is None else shape
    noise = torch.randn(shape, generator=generator, device=generator.device)
    if name.endswith("norm.weight") or name.endswith(("q_weight", "k_weight")) or "_scale" in name:
        return 1.0 + 0.2 * noise
    if name.endswith("attn_sink") or ".engram.embed." in name:
        return noise
    if name.endswith("_fn"):
        return noise * 0.5 / math.sqrt(shape[-1])
    if name.endswith("_base"):
        return 0.5 * noise
    if name.endswith(("gate.bias", "gate.bias_vl")):
        return 0.3 * noise
    if len(shape) >= 2:
        return noise / math.sqrt(shape[-1])
    return 0.5 * noise


def stored_tensors(spec: TensorSpec, value: torch.Tensor) -> dict[str, torch.Tensor]:
    """The on-disk tensor(s) for one fp32 value in the spec's released format."""
    if spec.fmt == "bf16":
        return {spec.name: value.to(torch.bfloat16)}
    if spec.fmt == "fp32":
        return {spec.name: value.float()}
    stored = quantize_weight(spec.name, value)
    if set(stored) != set(spec.stored()):
        raise AssertionError(f"{spec.name}: quantiser wrote {sorted(stored)}, table expects {sorted(spec.stored())}")
    return stored


def random_checkpoint(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """All released tensors for ``cfg``, drawn from ``seed`` in table order."""
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for spec in tensor_table(cfg).values():
        out.update(stored_tensors(spec, random_value(spec, generator)))
    return out


ROWS_PER_BAND = 1 << 20
"""Rows drawn and quantised at once on a device: a 72M-row Engram table is drawn band by band, so
the fp32 staging never exceeds ~1 GiB (a multiple of 32, so 32×32 FP8 blocks never straddle bands)."""


def random_stored_on_device(cfg: ModelConfig, seed: int, device: torch.device | str,
                            prefix: str | None = None) -> Iterator[dict[str, torch.Tensor]]:
    """The released tensors of ``cfg`` drawn directly on ``device``, one table entry at a time
    (each dict is one weight and its scale), for models too large for host memory (v41-s1).

    Each tensor draws from its own generator seeded by (seed, name), so the values do not depend on
    which names are asked for or in what order; they differ from ``random_checkpoint``'s CPU draws.
    Only names starting with ``prefix`` are produced when it is given (e.g. ``"layers.3."``).
    """
    for spec in tensor_table(cfg).values():
        if prefix is not None and not spec.name.startswith(prefix):
            continue
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
        rows = spec.shape[0]
        if len(spec.shape) < 2 or rows <= ROWS_PER_BAND:
            yield stored_tensors(spec, random_value(spec, generator))
            continue
        out = {key: torch.empty(shape, dtype=dtype, device=device) for key, (shape, dtype) in spec.stored().items()}
        for r in range(0, rows, ROWS_PER_BAND):
            band = stored_tensors(spec, random_value(spec, generator, (min(ROWS_PER_BAND, rows - r), *spec.shape[1:])))
            for key, value in band.items():
                start = r // 32 if spec.fmt == "fp8_block" and key != spec.name else r
                out[key][start : start + value.shape[0]] = value
        yield out


def write_random_checkpoint(out_dir: str | Path, cfg: ModelConfig, seed: int,
                            tokenizer: Tokenizer | None = None) -> Path:
    """Write a random checkpoint directory. ``tokenizer`` None means the real V4.1 vocabulary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(out, tokenizer)
    (out / "config.json").write_text(json.dumps(to_hf_dict(cfg), indent=2))
    write_checkpoint(random_checkpoint(cfg, seed), out, metadata={"format": "pt", "seed": str(seed)})
    return out


def init_preset(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """``shinkai model init``: a random checkpoint of a named preset."""
    cfg = preset(name)
    if name in GPU_ONLY:
        from model.deepseek_v41.checkpoint import stored_bytes

        raise ValueError(
            f"preset {name!r} is {stored_bytes(cfg) / 1e9:.0f} GB of weights; it is created from a seed directly "
            "in GPU memory and never written to disk, so --out is refused"
        )
    return write_random_checkpoint(out_dir, cfg, seed)
