"""Where the engine's model comes from: a checkpoint directory, or a preset built in memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.loader import assign_weights, check_tensors, load_checkpoint
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.presets import GPU_ONLY, PRESETS, preset
from model.deepseek_v41.tokenizer import engram_token_map, load_tokenizer, load_v41_tokenizer


@dataclass
class ModelSource:
    name: str
    config: ModelConfig
    model: DeepseekV41
    tokenizer: Tokenizer


def load_model(model: str, seed: int = 0) -> ModelSource:
    """``model`` is a checkpoint directory or a preset name; a preset's weights come from ``seed``."""
    if model in PRESETS:
        if model in GPU_ONLY:
            raise ValueError(f"preset {model!r} is built in GPU memory only; the CPU engine serves 'tiny'")
        cfg = preset(model)
        tokenizer = load_v41_tokenizer()
        from model.deepseek_v41.init import random_checkpoint

        tensors = random_checkpoint(cfg, seed)
        check_tensors(cfg, tensors)
        token_map, num_compressed = engram_token_map(tokenizer) if cfg.engram_layer_ids else (None, None)
        net = DeepseekV41(cfg, token_map, num_compressed)
        assign_weights(net, tensors)
        return ModelSource(model, cfg, net.eval(), tokenizer)
    path = Path(model)
    if not path.is_dir():
        raise ValueError(f"model {model!r} is neither a checkpoint directory nor a preset ({', '.join(PRESETS)})")
    loaded = load_checkpoint(path)
    return ModelSource(str(path), loaded.config, loaded.model, load_tokenizer(path))
