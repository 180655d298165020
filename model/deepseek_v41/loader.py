"""Load a checkpoint directory (``config.json``, tokenizer, ``model.safetensors``) in released formats.

Every stored tensor is checked against ``checkpoint.stored_table(config)`` first: a missing, extra,
misshaped or wrongly typed tensor raises ``CheckpointError`` naming it. Quantised weights are
dequantised to fp32 for the CPU model, and the original bytes are kept in
``LoadedCheckpoint.quantized`` (name → (weight, scale)) for GPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from model.deepseek_v41.checkpoint import QUANTIZED, tensor_table, vision_specs
from model.deepseek_v41.config import ModelConfig, load_config
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.quant import dequantize_weight
from model.deepseek_v41.safetensors_io import CheckpointError, read_checkpoint
from model.deepseek_v41.tokenizer import engram_token_map, load_tokenizer
from model.deepseek_v41.vision import ImageEncoder


@dataclass
class LoadedCheckpoint:
    config: ModelConfig
    model: DeepseekV41
    quantized: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def check_tensors(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming the first missing, unexpected, misshaped or mistyped tensors."""
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for spec in tensor_table(cfg).values():
        expected.update(spec.stored())
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s): {', '.join(missing[:5])}")
    extra = sorted(set(tensors) - set(expected))
    if extra:
        raise CheckpointError(f"checkpoint has {len(extra)} unexpected tensor(s): {', '.join(extra[:5])}")
    for name, (shape, dtype) in expected.items():
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise CheckpointError(f"tensor {name} has shape {list(t.shape)}, expected {list(shape)}")
        if t.dtype != dtype:
            raise CheckpointError(f"tensor {name} has dtype {t.dtype}, expected {dtype}")


def assign_weights(
    model: DeepseekV41, tensors: dict[str, torch.Tensor]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Copy checked released tensors into ``model`` (fp32); returns the quantised originals."""
    params = dict(model.named_parameters())
    quantized = {}
    filled = set()
    with torch.no_grad():
        for spec in tensor_table(model.cfg).values():
            stored = tensors[spec.name]
            if spec.fmt in QUANTIZED:
                scale = tensors[spec.name.removesuffix(".weight") + ".scale"]
                quantized[spec.name] = (stored, scale)
                value = dequantize_weight(stored, scale, rowwise=spec.fmt == "fp8_rowwise")
            else:
                value = stored
            target = params[spec.target]
            (target if spec.index is None else target[spec.index]).copy_(value.float())
            filled.add((spec.target, spec.index))
    unfilled = {name for name in params if not any(t == name for t, _ in filled)}
    if unfilled:
        raise CheckpointError(f"model parameters without a checkpoint tensor: {sorted(unfilled)[:5]}")
    return quantized


def load_image_encoder(cfg: ModelConfig, tensors: dict[str, torch.Tensor]) -> ImageEncoder:
    """The vision tower alone (fp32, eval) from released tensors holding at least ``vision_specs(cfg)``'s,
    each checked for shape and dtype; the multimodal service runs it without the backbone."""
    if cfg.vision is None:
        raise CheckpointError("this model has no vision tower (vision_config.num_hidden_layers is 0)")
    encoder = ImageEncoder(cfg.vision, cfg.hidden_size)
    params = dict(encoder.named_parameters())
    with torch.no_grad():
        for spec in vision_specs(cfg):
            ((shape, dtype),) = spec.stored().values()
            stored = tensors.get(spec.name)
            if stored is None:
                raise CheckpointError(f"checkpoint is missing tensor {spec.name}")
            if tuple(stored.shape) != shape or stored.dtype != dtype:
                raise CheckpointError(
                    f"tensor {spec.name} is {list(stored.shape)} {stored.dtype}, expected {list(shape)} {dtype}"
                )
            params[spec.target.removeprefix("encoder.")].copy_(stored.float())
    return encoder.eval()


def read_image_encoder(path: str | Path) -> ImageEncoder:
    """``load_image_encoder`` from a checkpoint directory, reading only the vision tensors."""
    from safetensors import safe_open

    from model.deepseek_v41.safetensors_io import checkpoint_files

    cfg = load_config(path)
    files = checkpoint_files(path)
    tensors = {}
    for spec in vision_specs(cfg) if cfg.vision is not None else []:
        if spec.name in files:
            with safe_open(str(files[spec.name]), framework="pt") as f:
                tensors[spec.name] = f.get_tensor(spec.name)
    return load_image_encoder(cfg, tensors)


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Build the CPU fp32 model from a checkpoint directory."""
    path = Path(path)
    cfg = load_config(path)
    token_map = num_compressed = None
    if cfg.engram_layer_ids:
        token_map, num_compressed = engram_token_map(load_tokenizer(path))
    tensors = read_checkpoint(path)
    check_tensors(cfg, tensors)
    model = DeepseekV41(cfg, token_map, num_compressed)
    quantized = assign_weights(model, tensors)
    return LoadedCheckpoint(cfg, model.eval(), quantized)
