"""DeepSeek-V4.1 vision configuration (spec §2 ``vision_config``, §3.13), read from the composite
HF ``config.json``: the ViT's shape, the image sizing rules and the placeholder id.

``vision_config.num_hidden_layers = 0`` (NeMo's text-only switch) means no tower: the model config
then carries ``vision=None`` and the checkpoint has no ``vision.*``/``aligner.*``/``image_*`` tensors.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

IMAGE_TOKEN_ID = 129264  # the released placeholder id (top-level ``image_token_id``)


@dataclass(frozen=True)
class VisionConfig:
    """The released tower's fields under their HF/NeMo ``vision_config`` names (Flash values as defaults)."""

    num_hidden_layers: int = 32  # ViT blocks
    hidden_size: int = 1024  # ViT width
    num_attention_heads: int = 16  # ViT heads; head_dim = hidden_size / heads, a multiple of 4 (2D RoPE)
    intermediate_size: int = 2816  # SwiGLU width of each block's MLP
    patch_size: int = 14  # pixels per patch side
    rope_theta: float = 10000.0  # 2D RoPE base
    downsample_ratio: int = 3  # ViT patches per image token side (the aligner's pixel-unshuffle)
    max_image_tokens: int = 1024  # whole span (start, rows with their newline, end) per image, at most
    min_pixels: int = 295936  # smaller images are scaled up to this area before patching
    max_wh_ratio: float | None = None  # wider images are squeezed to this width/height; None: never
    image_token_id: int = IMAGE_TOKEN_ID  # the placeholder every image-span position carries

    def __post_init__(self) -> None:
        for name in (
            "num_hidden_layers",
            "hidden_size",
            "num_attention_heads",
            "intermediate_size",
            "patch_size",
            "downsample_ratio",
            "max_image_tokens",
            "min_pixels",
        ):
            value = getattr(self, name)
            if type(value) is not int or value <= 0:
                raise ValueError(f"vision {name} must be a positive integer, got {value!r}")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 4:
            raise ValueError("vision hidden_size / num_attention_heads must be a multiple of 4 (2D RoPE halves)")
        if not math.isfinite(self.rope_theta) or self.rope_theta <= 0:
            raise ValueError(f"vision rope_theta must be finite and positive, got {self.rope_theta!r}")
        if self.max_wh_ratio is not None and (not math.isfinite(self.max_wh_ratio) or self.max_wh_ratio < 1):
            raise ValueError(f"vision max_wh_ratio must be None or at least 1, got {self.max_wh_ratio!r}")
        if self.max_image_tokens < 4:
            raise ValueError("vision max_image_tokens must be at least 4 (start, one token, newline, end)")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


_FIELDS = [f.name for f in dataclasses.fields(VisionConfig) if f.name != "image_token_id"]


def vision_from_hf(data: dict[str, Any]) -> VisionConfig | None:
    """The tower described by a composite config dict; None when it has no ``vision_config`` or 0 layers."""
    raw = data.get("vision_config")
    if raw is None or raw.get("num_hidden_layers", VisionConfig.num_hidden_layers) == 0:
        return None
    kwargs = {name: raw[name] for name in _FIELDS if name in raw}
    if "image_token_id" in data:
        kwargs["image_token_id"] = data["image_token_id"]
    return VisionConfig(**kwargs)


def vision_to_hf(vision: VisionConfig | None) -> dict[str, Any]:
    """``vision_config`` and ``image_token_id`` entries of the composite config dict."""
    if vision is None:
        return {"vision_config": {"num_hidden_layers": 0}}
    return {"vision_config": {name: getattr(vision, name) for name in _FIELDS}, "image_token_id": vision.image_token_id}
