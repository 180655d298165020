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
import shutil
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer

from model.deepseek_v41.checkpoint import TensorSpec, tensor_table
from model.deepseek_v41.config import ModelConfig, to_hf_dict
from model.deepseek_v41.presets import GPU_ONLY, preset
from model.deepseek_v41.quant import quantize_weight
from model.deepseek_v41.safetensors_io import write_checkpoint, write_index, write_safetensors
from model.deepseek_v41.tokenizer import write_tokenizer_files


def random_value(spec: TensorSpec, generator: torch.Generator, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """One fp32 tensor of ``spec.shape`` (or of ``shape``, a band of its rows) drawn by the rule for its
    name, on the generator's device."""
    name = spec.name
    shape = spec.shape if shape is None else shape
    noise = torch.randn(shape, generator=generator, device=generator.device)
    if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "q_weight", "k_weight")) or "_scale" in name:
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


def random_stored_on_device(
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str,
    prefix: str | None = None,
    on_host: Callable[[str], bool] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """The released tensors of ``cfg`` drawn directly on ``device``, one table entry at a time
    (each dict is one weight and its scale), for models too large for host memory (v41-s1).

    Each tensor draws from its own generator seeded by (seed, name), so the values do not depend on
    which names are asked for or in what order; they differ from ``random_checkpoint``'s CPU draws.
    Only names starting with ``prefix`` are produced when it is given (e.g. ``"layers.3."``). Tensors whose
    name ``on_host`` accepts are drawn on ``device`` a band at a time and kept on the host (the same values):
    the device never holds more than one band of them (``--engram-on-host``'s tables).
    """
    for spec in tensor_table(cfg).values():
        if prefix is not None and not spec.name.startswith(prefix):
            continue
        generator = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(spec.name.encode()))
        rows = spec.shape[0]
        host = on_host is not None and on_host(spec.name)
        if len(spec.shape) < 2 or rows <= ROWS_PER_BAND:
            drawn = stored_tensors(spec, random_value(spec, generator))
            yield {key: value.cpu() for key, value in drawn.items()} if host else drawn
            continue
        where = "cpu" if host else device
        out = {key: torch.empty(shape, dtype=dtype, device=where) for key, (shape, dtype) in spec.stored().items()}
        for r in range(0, rows, ROWS_PER_BAND):
            band = stored_tensors(spec, random_value(spec, generator, (min(ROWS_PER_BAND, rows - r), *spec.shape[1:])))
            for key, value in band.items():
                start = r // 32 if spec.fmt == "fp8_block" and key != spec.name else r
                out[key][start : start + value.shape[0]] = value
        yield out


def write_random_checkpoint(
    out_dir: str | Path, cfg: ModelConfig, seed: int, tokenizer: Tokenizer | None = None
) -> Path:
    """Write a random checkpoint directory. ``tokenizer`` None means the real V4.1 vocabulary."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(out, tokenizer)
    (out / "config.json").write_text(json.dumps(to_hf_dict(cfg), indent=2))
    write_checkpoint(random_checkpoint(cfg, seed), out, metadata={"format": "pt", "seed": str(seed)})
    return out


def checkpoint_parts(cfg: ModelConfig) -> list[tuple[str, ...]]:
    """Name prefixes per shard of the sharded layout: embed, norm and head first, then one layer each, then
    the DSpark draft and the vision tower, each when the config has one (the table's order)."""
    draft = [("mtp.",)] if cfg.num_nextn_predict_layers else []
    vision = [("vision.", "aligner.", "image_")] if cfg.vision is not None else []
    return [("embed.", "norm.", "head."), *((f"layers.{i}.",) for i in range(cfg.num_hidden_layers)), *draft, *vision]


def write_sharded_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    seed: int,
    device: torch.device | str = "cpu",
    tokenizer: Tokenizer | None = None,
    log=None,
) -> Path:
    """Write a random checkpoint directory in the released sharded layout (``model-0000X-of-0000N.safetensors``
    plus ``model.safetensors.index.json``), one part per shard, drawn on ``device`` by
    ``random_stored_on_device`` (so it holds the same bytes as that build from ``seed``). Host memory
    holds one part at a time."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(out, tokenizer)
    (out / "config.json").write_text(json.dumps(to_hf_dict(cfg), indent=2))
    parts = checkpoint_parts(cfg)
    weight_map: dict[str, str] = {}
    total = 0
    for k, prefixes in enumerate(parts, start=1):
        tensors: dict[str, torch.Tensor] = {}
        for prefix in prefixes:
            for entry in random_stored_on_device(cfg, seed, device, prefix=prefix):
                tensors.update(entry)
        shard = f"model-{k:05d}-of-{len(parts):05d}.safetensors"
        write_safetensors(tensors, out / shard, {"format": "pt", "seed": str(seed)})
        weight_map.update({name: shard for name in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if log is not None:
            log(f"wrote {shard} ({prefixes[0]}…)")
    write_index(out, weight_map, total)
    return out


def init_preset(
    name: str,
    out_dir: str | Path,
    seed: int = 0,
    num_layers: int | None = None,
    device: torch.device | str | None = None,
    log=None,
) -> Path:
    """``shinkai model init``: a random checkpoint of a named preset, or of its first ``num_layers`` layers.

    ``tiny`` at full depth is written as one ``model.safetensors`` drawn on the CPU (``random_checkpoint``);
    GPU presets, and any preset cut to ``num_layers``, in the sharded layout drawn on ``device`` (default:
    cuda when available, else cpu)."""
    cfg = preset(name)
    if num_layers is not None:
        if not 1 <= num_layers <= cfg.num_hidden_layers:
            raise ValueError(
                f"--num-layers must be between 1 and {cfg.num_hidden_layers} for {name!r}, got {num_layers}"
            )
        cfg = first_layers(cfg, num_layers)
    elif name not in GPU_ONLY:
        return write_random_checkpoint(out_dir, cfg, seed)
    from model.deepseek_v41.checkpoint import stored_bytes

    need = stored_bytes(cfg)
    existing = next((p for p in [Path(out_dir), *Path(out_dir).absolute().parents] if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free
    if need > free:
        raise ValueError(
            f"preset {name!r} with {cfg.num_hidden_layers} layers is {need / 1e9:.1f} GB of weights but "
            f"{existing} has {free / 1e9:.1f} GB free; write fewer layers with --num-layers"
        )
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return write_sharded_checkpoint(out_dir, cfg, seed, device, log=log)


def first_layers(cfg: ModelConfig, num_layers: int) -> ModelConfig:
    """``cfg`` cut to its first ``num_layers`` layers, each keeping its role (ratio, sources, Engram table);
    the DSpark draft stays only if every layer it taps stays."""
    import dataclasses

    keep = range(num_layers)
    engram = [(i, rows) for i, rows in zip(cfg.engram_layer_ids, cfg.engram_num_embeddings) if i in keep]
    candidate = cfg.candidate_source_layer_id if cfg.candidate_source_layer_id in keep else None
    return dataclasses.replace(
        cfg,
        num_hidden_layers=num_layers,
        compress_ratios=tuple(cfg.ratio(i) for i in keep) + tuple(cfg.compress_ratios[cfg.num_hidden_layers :]),
        kv_source_layer_ids=tuple(i for i in cfg.kv_source_layer_ids if i in keep),
        index_source_layer_ids=tuple(i for i in cfg.index_source_layer_ids if i in keep),
        candidate_source_layer_id=candidate,
        engram_layer_ids=tuple(i for i, _ in engram),
        engram_num_embeddings=tuple(rows for _, rows in engram),
        num_nextn_predict_layers=cfg.num_nextn_predict_layers if max(cfg.dspark_target_layer_ids) < num_layers else 0,
    )
