"""Preprocessing: the patches equal NeMo's V4.1 processor's bit for bit (tiny and released configs), and
every bad input is refused with a message naming the problem."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from model.deepseek_v41.presets import TINY
from model.deepseek_v41.vision_config import VisionConfig
from services.multimodal.preprocess import ImageInputError, ImageLimits, open_image, prepare_image

FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "intermediate_size",
    "patch_size",
    "rope_theta",
    "downsample_ratio",
    "max_image_tokens",
    "min_pixels",
    "max_wh_ratio",
)


def encoded(width: int, height: int, fmt: str = "PNG", seed: int = 0, mode: str = "RGB") -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, fmt)
    return out.getvalue()


@pytest.mark.parametrize(
    "vcfg", [TINY.vision, VisionConfig(), VisionConfig(max_wh_ratio=2.0)], ids=["tiny", "flash", "flash-squeeze"]
)
@pytest.mark.parametrize(
    "size,fmt", [((100, 80), "PNG"), ((37, 200), "JPEG"), ((640, 480), "WEBP"), ((300, 20), "GIF")]
)
def test_patches_equal_nemos_processor(vcfg, size, fmt):
    nemo = pytest.importorskip("nemo_automodel.components.models.deepseek_v41.processing")
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41VisionConfig

    data = encoded(*size, fmt)
    ours = prepare_image(data, vcfg, ImageLimits())
    theirs, grid = nemo._preprocess_image(data, DeepseekV41VisionConfig(**{k: getattr(vcfg, k) for k in FIELDS}))
    assert (ours.grid.patch_rows, ours.grid.patch_cols) == (grid.vit_height, grid.vit_width)
    assert ours.source_size == size
    assert torch.equal(ours.patches, theirs.float())


def flat_png(width: int, height: int) -> bytes:
    """A flat PNG: few bytes for many pixels."""
    out = io.BytesIO()
    Image.new("RGB", (width, height), (9, 9, 9)).save(out, "PNG")
    return out.getvalue()


def test_modes_other_than_rgb_are_converted():
    for mode in ("RGBA", "L", "P"):
        assert open_image(encoded(20, 20, "PNG", mode=mode), ImageLimits()).mode == "RGB"


def test_bad_images_are_refused_by_name():
    limits = ImageLimits(max_bytes=4000, max_pixels=10_000)
    cases = [
        (b"", "empty"),
        (b"not an image at all", "not in a supported format"),
        (encoded(40, 40)[:300], "corrupt or truncated"),
        (encoded(30, 30, "TIFF"), "format TIFF is not supported"),
        (encoded(30, 30, "BMP"), "format BMP is not supported"),
        (encoded(120, 120, "PNG"), "over the limit of 4000"),
        (flat_png(200, 60), "12000 pixels, over the limit of 10000"),
    ]
    for data, message in cases:
        with pytest.raises(ImageInputError, match=message):
            prepare_image(data, TINY.vision, limits)
