"""A rendered chat's images → the prompt the model reads: each image's one placeholder token (the recipe's
``<｜image｜>``) expanded to its span of ``image_token_id`` positions, and the span embeddings [P, D] that
fill them, from the model's own vision tower (the offline path; served requests use services/multimodal,
which runs the same preprocessing and tower)."""

from __future__ import annotations

import torch

from model.deepseek_v41.model import DeepseekV41
from services.multimodal.image_fetch import fetch_image
from services.multimodal.preprocess import ImageInputError, ImageLimits, prepare_image


def expand_images(ids: list[int], urls: list[str], placeholder_id: int, model: DeepseekV41,
                  limits: ImageLimits = ImageLimits()) -> tuple[list[int], torch.Tensor | None]:
    """(prompt ids with every image's span in place of its placeholder, span rows [P, D] or None without
    images). ImageInputError names a bad image or URL; ValueError when the model has no vision tower."""
    if ids.count(placeholder_id) != len(urls):
        raise ValueError(f"the prompt has {ids.count(placeholder_id)} image placeholders for {len(urls)} images")
    if not urls:
        return ids, None
    if model.encoder is None or model.cfg.vision is None:
        raise ValueError("this model has no vision tower: image_url parts need one")
    if len(urls) > limits.max_images:
        raise ImageInputError(f"{len(urls)} images in one request, over the limit of {limits.max_images}")
    images = [prepare_image(fetch_image(url, limits.max_bytes), model.cfg.vision, limits) for url in urls]
    device = model.embed.weight.device
    with torch.no_grad():
        spans = model.encoder(torch.cat([image.patches for image in images]).to(device),
                              [(image.grid.patch_rows, image.grid.patch_cols) for image in images])
    out: list[int] = []
    spans_left = iter(spans)
    for token in ids:
        if token == placeholder_id:
            out.extend([model.cfg.vision.image_token_id] * next(spans_left).shape[0])
        else:
            out.append(token)
    return out, torch.cat(spans).float()
