"""Where the multimodal service's vision tower comes from: a checkpoint directory (only its vision
tensors are read), or a preset's weights drawn from its seed exactly as the engine draws them."""

from __future__ import annotations

from pathlib import Path

from model.deepseek_v41.config import ModelConfig, load_config
from model.deepseek_v41.loader import load_image_encoder, read_image_encoder
from model.deepseek_v41.presets import PRESETS, preset
from model.deepseek_v41.vision import ImageEncoder


def load_encoder(model: str, seed: int = 0) -> tuple[ModelConfig, ImageEncoder]:
    """(config, fp32 encoder in eval mode) for a preset name or a checkpoint directory."""
    if model in PRESETS:
        from model.deepseek_v41.init import random_checkpoint

        cfg = preset(model)
        if cfg.vision is None:
            raise ValueError(f"preset {model!r} has no vision tower")
        return cfg, load_image_encoder(cfg, random_checkpoint(cfg, seed))
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")
    return load_config(path), read_image_encoder(path)
