"""A rendered chat's images → the prompt the model reads: each image's one placeholder token (the recipe's
``<｜image｜>``, id 129279) expanded to its span of ``image_token_id`` positions (129264), and the span
embeddings [P, D] that fill them.

- `expand_placeholders` is the one expansion rule, used by both paths below.
- `expand_images` is the offline path (`LLM.chat`): URLs fetched here, the model's own vision tower.
- `ImagePrompts` is the served path: the gateway has fetched the bytes; spans are planned here from the
  image headers (the scheduler needs the expanded prompt before any embedding exists) and the embeddings
  come from an `ImageEncoder` (the multimodal service) while the request waits behind the readiness gate.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

import torch

from model.deepseek_v41.image_grid import ImageGrid
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.vision_config import VisionConfig
from services.multimodal.image_fetch import fetch_image
from services.multimodal.preprocess import ImageInputError, ImageLimits, peek_grid, prepare_image

NO_TOWER = "this model has no vision tower: image_url parts need one"


def expand_placeholders(
    ids: Sequence[int], placeholder_id: int, image_token_id: int, span_lengths: Sequence[int]
) -> list[int]:
    """``ids`` with its i-th ``placeholder_id`` replaced by ``span_lengths[i]`` copies of ``image_token_id``."""
    if list(ids).count(placeholder_id) != len(span_lengths):
        raise ValueError(
            f"the prompt has {list(ids).count(placeholder_id)} image placeholders for {len(span_lengths)} images"
        )
    out: list[int] = []
    spans_left = iter(span_lengths)
    for token in ids:
        if token == placeholder_id:
            out.extend([image_token_id] * next(spans_left))
        else:
            out.append(token)
    return out


def check_count(num_images: int, limits: ImageLimits) -> None:
    if num_images > limits.max_images:
        raise ImageInputError(f"{num_images} images in one request, over the limit of {limits.max_images}")


def expand_images(
    ids: list[int],
    urls: list[str],
    placeholder_id: int,
    model: DeepseekV41,
    limits: ImageLimits = ImageLimits(),
    allow_private: bool = True,
) -> tuple[list[int], torch.Tensor | None]:
    """(prompt ids with every image's span in place of its placeholder, span rows [P, D] or None without
    images). ImageInputError names a bad image or URL; ValueError when the model has no vision tower.
    ``allow_private``: offline, the caller is the operator, so URLs may name private addresses."""
    if ids.count(placeholder_id) != len(urls):
        raise ValueError(f"the prompt has {ids.count(placeholder_id)} image placeholders for {len(urls)} images")
    if not urls:
        return ids, None
    if model.encoder is None or model.cfg.vision is None:
        raise ValueError(NO_TOWER)
    check_count(len(urls), limits)
    images = [
        prepare_image(fetch_image(url, limits.max_bytes, allow_private=allow_private), model.cfg.vision, limits)
        for url in urls
    ]
    device = model.embed.weight.device
    with torch.no_grad():
        spans = model.encoder(
            torch.cat([image.patches for image in images]).to(device),
            [(image.grid.patch_rows, image.grid.patch_cols) for image in images],
        )
    out = expand_placeholders(ids, placeholder_id, model.cfg.vision.image_token_id, [s.shape[0] for s in spans])
    return out, torch.cat(spans).float()


class ImageEncoderUnavailable(Exception):
    """The image encoder (the multimodal service) cannot answer now: a 503 / UNAVAILABLE, never bad input."""


class ImageEncoder(Protocol):
    async def encode(self, image: bytes) -> torch.Tensor:
        """The span embeddings [num_tokens, D] fp32 of one encoded image. ImageInputError for a bad image,
        ImageEncoderUnavailable when the encoder cannot answer."""
        ...


class ImagePrompts:
    """The served image path's two halves around the readiness gate: ``expand`` before the request is
    queued (cheap: image headers only), ``embeddings`` while it waits."""

    def __init__(
        self,
        vision: VisionConfig | None,
        placeholder_id: int | None,
        encoder: ImageEncoder | None,
        limits: ImageLimits = ImageLimits(),
        refusal: str | None = None,
    ) -> None:
        self.vision = vision  # the served model's tower config; None: it has none, images are refused
        self.placeholder_id = placeholder_id  # the recipe's image token id in rendered prompts
        self.encoder = encoder  # None: images are refused (no tower, or a worker that cannot take them)
        self.limits = limits
        self.refusal = refusal  # why a model with a tower takes no images here (encoder None)

    def expand(self, ids: Sequence[int], images: Sequence[bytes]) -> tuple[list[int], list[ImageGrid]]:
        """(the prompt with each placeholder expanded to its image's span, each image's grid). ValueError
        (ImageInputError for the images themselves) naming what is wrong."""
        if self.vision is None or self.placeholder_id is None:
            raise ValueError(NO_TOWER)
        if self.encoder is None:
            raise ValueError(self.refusal or "this engine takes no images")
        check_count(len(images), self.limits)
        grids = [peek_grid(image, self.vision, self.limits) for image in images]
        ids = expand_placeholders(ids, self.placeholder_id, self.vision.image_token_id, [g.num_tokens for g in grids])
        return ids, grids

    async def embeddings(self, images: Sequence[bytes], grids: Sequence[ImageGrid]) -> torch.Tensor:
        """The spans of all images, concatenated in prompt order [P, D] fp32; encoded concurrently."""
        assert self.encoder is not None and self.vision is not None
        spans = await asyncio.gather(*(self.encoder.encode(image) for image in images))
        for i, (span, grid) in enumerate(zip(spans, grids)):
            if span.shape[0] != grid.num_tokens:  # the encoder serves another model (or another config)
                raise ImageEncoderUnavailable(
                    f"the image encoder returned {span.shape[0]} embeddings for image {i}, whose span here has "
                    f"{grid.num_tokens}: it does not serve this model"
                )
        return torch.cat(list(spans))
