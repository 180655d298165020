"""Image bytes → normalised patches for the vision tower, with the input limits.

Decoding is Pillow's; the pixel pipeline is NeMo's V4.1 processor's (the released one): RGB, letterbox
to the planned size (``ImageOps.pad``: bicubic, aspect kept, centred, grey 127 borders; a plain resize
when the config's ``max_wh_ratio`` squeezes the image), x/255, (x − 0.5)/0.5 rounded to BF16, then
row-major patches [patch_rows·patch_cols, 3, p, p] in fp32. The size plan is ``plan_image_grid``.

Every refusal is an ``ImageInputError`` whose text names the problem (a 400 / INVALID_ARGUMENT).
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from model.deepseek_v41.image_grid import ImageGrid, plan_image_grid
from model.deepseek_v41.vision_config import VisionConfig

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
"""Pillow format names accepted (the ones deepseek-recipe accepts); an animated GIF or WebP gives its first frame."""


class ImageInputError(ValueError):
    """An image that cannot be used; the text says why."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 2**20  # encoded bytes of one image
    max_pixels: int = 50_000_000  # width × height as decoded (before any resize)
    max_images: int = 8  # images in one request


@dataclass(frozen=True)
class PreparedImage:
    patches: torch.Tensor  # fp32 [patch_rows·patch_cols, 3, p, p], row-major, values in [-1, 1] (BF16-exact)
    grid: ImageGrid  # the resize and the patch and token grids
    source_size: tuple[int, int]  # (width, height) as decoded


def open_image(data: bytes, limits: ImageLimits) -> Image.Image:
    """The decoded RGB image; ImageInputError for empty, oversized, corrupt, truncated or unsupported input."""
    image = _open_header(data, limits)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image.load()
    except Exception as err:  # a decoder's failure on untrusted bytes, of whatever type Pillow's plugin raises
        raise ImageInputError(f"the {image.format} image is corrupt or truncated: {_said(err)}") from None
    try:
        return image.convert("RGB")
    except Exception as err:  # a pixel mode without a conversion to RGB
        raise ImageInputError(f"the {image.format} image's mode {image.mode} is not supported: {_said(err)}") from None


def _said(err: Exception) -> str:
    """A decoder error as the client reads it: its text (or its type when it has none), cut to 200 characters."""
    return (str(err) or type(err).__name__)[:200]


def _open_header(data: bytes, limits: ImageLimits) -> Image.Image:
    """The image opened lazily (header read, pixels not), its bytes, format and pixel count checked."""
    if not data:
        raise ImageInputError("the image is empty")
    if len(data) > limits.max_bytes:
        raise ImageInputError(f"the image is {len(data)} bytes, over the limit of {limits.max_bytes}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # the pixel limit below decides
            image = Image.open(io.BytesIO(data), formats=None)
    except Image.DecompressionBombError as err:
        # Pillow refuses a header past twice its own limit (``Image.MAX_IMAGE_PIXELS``, above ``max_pixels``)
        # before returning it; its text holds the pixel count.
        found = re.search(r"\((\d+) pixels\)", str(err))
        size = f"{found.group(1)} pixels" if found else "over Pillow's decompression-bomb limit"
        raise ImageInputError(f"the image is {size}, over the limit of {limits.max_pixels}") from None
    except UnidentifiedImageError:
        raise ImageInputError(f"the image is not in a supported format ({', '.join(FORMATS)}) or is corrupt") from None
    except Exception as err:  # a header Pillow's plugin fails on (a truncated JPEG: OSError)
        raise ImageInputError(f"the image's header is corrupt or truncated: {_said(err)}") from None
    if image.format not in FORMATS:
        raise ImageInputError(f"image format {image.format} is not supported; use one of {', '.join(FORMATS)}")
    width, height = image.size
    if width * height > limits.max_pixels:
        raise ImageInputError(
            f"the image is {width}x{height} = {width * height} pixels, over the limit of {limits.max_pixels}"
        )
    return image


def peek_grid(data: bytes, vcfg: VisionConfig, limits: ImageLimits) -> ImageGrid:
    """The image's size plan from its header alone (no pixel decode): what the placeholder expansion needs.
    Refuses what ``open_image`` refuses, except damage past the header (``prepare_image`` finds that)."""
    image = _open_header(data, limits)
    try:
        return plan_image_grid(image.width, image.height, vcfg)
    except ValueError as err:
        raise ImageInputError(str(err)) from None


def prepare_image(data: bytes, vcfg: VisionConfig, limits: ImageLimits) -> PreparedImage:
    """Encoded bytes → the tower's patches and the image's grids."""
    image = open_image(data, limits)
    source = image.size
    try:
        grid = plan_image_grid(image.width, image.height, vcfg)
    except ValueError as err:
        raise ImageInputError(str(err)) from None
    if vcfg.max_wh_ratio is not None and image.width >= vcfg.max_wh_ratio * image.height:
        image = image.resize((grid.width, grid.height))
    else:
        image = ImageOps.pad(image, (grid.width, grid.height), color=(127, 127, 127))
    pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1) / 255  # [3, H, W]
    pixels = ((pixels - 0.5) / 0.5).to(torch.bfloat16).float()
    p = vcfg.patch_size
    patches = (
        pixels.reshape(3, grid.patch_rows, p, grid.patch_cols, p)
        .permute(1, 3, 0, 2, 4)
        .reshape(grid.patch_rows * grid.patch_cols, 3, p, p)
    )
    return PreparedImage(patches.contiguous(), grid, source)
