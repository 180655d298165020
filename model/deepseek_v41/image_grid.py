"""Image sizing (spec §3.13; DeepSeek's recipe and NeMo's V4.1 processor): an image's pixel size →
the size it is resized to, its ViT patch grid and its image-token grid.

1. A width beyond ``max_wh_ratio`` × height is squeezed to that ratio (when the config sets one).
2. An area below ``min_pixels`` is scaled up to it, aspect kept (sides truncated to integers).
3. Sides round up to whole patches; the token grid is ⌈patch grid / downsample⌉ per side.
4. If the span (rows·(cols+1) + 2 tokens: start, rows with a newline each, end) exceeds
   ``max_image_tokens``, the image is scaled down, aspect kept, to the largest whole number of
   (patch · downsample) cells per side that fits: cols is the largest with
   rows·(cols+1) + 2 ≤ budget at this aspect, then sides round down to whole patches.

For the released config (patch 14, downsample 3, min 295,936 pixels, 1,024 tokens) the token count
equals deepseek-recipe's placeholder expansion (``MultiModalData.image_token_adjustment`` + 1),
checked over many sizes in the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model.deepseek_v41.vision import span_length
from model.deepseek_v41.vision_config import VisionConfig


@dataclass(frozen=True)
class ImageGrid:
    width: int  # pixels after resizing (a whole number of patches)
    height: int
    patch_rows: int  # ViT grid: height / patch_size
    patch_cols: int  # width / patch_size
    rows: int  # image-token grid: ⌈patch_rows / downsample⌉
    cols: int  # ⌈patch_cols / downsample⌉

    @property
    def num_tokens(self) -> int:
        """Placeholder positions of this image's span."""
        return span_length(self.rows, self.cols)


def plan_image_grid(width: int, height: int, vcfg: VisionConfig) -> ImageGrid:
    """The resize and grids for an image of ``width`` × ``height`` pixels; ValueError if it cannot fit."""
    if width <= 0 or height <= 0:
        raise ValueError(f"image size {width}x{height} must be positive")
    w: float = width
    h: float = height
    if vcfg.max_wh_ratio is not None and width > height * vcfg.max_wh_ratio:
        w = height * vcfg.max_wh_ratio
    if w * h < vcfg.min_pixels:
        scale = math.sqrt(vcfg.min_pixels / (w * h))
        w, h = int(w * scale), int(h * scale)
    p, r = vcfg.patch_size, vcfg.downsample_ratio
    out_w, out_h = math.ceil(w / p) * p, math.ceil(h / p) * p

    def tokens(ow: int, oh: int) -> int:
        return span_length(math.ceil(oh // p / r), math.ceil(ow // p / r))

    if tokens(out_w, out_h) > vcfg.max_image_tokens:
        aspect = h / w
        budget = vcfg.max_image_tokens - 2
        max_cols = math.sqrt(budget / aspect + 0.25) - 0.5  # rows·(cols+1) = budget with rows = aspect·cols
        max_rows = max_cols * aspect
        cell = p * r
        if max_cols < 1:  # a tall sliver: one column
            out_h, out_w = budget // 2 * cell, cell
        elif max_rows < 1:  # a wide sliver: one row
            out_h, out_w = cell, (budget - 1) * cell
        else:
            scale = min(math.floor(max_cols) * cell / w, math.floor(max_rows) * cell / h)
            out_h = math.floor(h * scale / p) * p
            out_w = math.floor(w * scale / p) * p
    if min(out_w, out_h) <= 0 or tokens(out_w, out_h) > vcfg.max_image_tokens:
        raise ValueError(f"a {width}x{height} image cannot fit in {vcfg.max_image_tokens} image tokens")
    patch_rows, patch_cols = out_h // p, out_w // p
    return ImageGrid(out_w, out_h, patch_rows, patch_cols, math.ceil(patch_rows / r), math.ceil(patch_cols / r))
