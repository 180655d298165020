"""The served image path's engine half (`ImagePrompts`): the one expansion rule, spans planned from the
image headers alone, and each refusal naming its problem (no tower, no encoder, too many images, a bad
header, an encoder that serves another model)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model.deepseek_v41.presets import preset
from services.engine.images.prompt import ImageEncoderUnavailable, ImagePrompts, expand_placeholders
from services.multimodal.preprocess import ImageInputError, ImageLimits, peek_grid
from tests.services.multimodal.test_service import png

PLACEHOLDER = 129279
VISION = preset("tiny").vision


class _Rows:
    """An encoder that answers ``num_tokens`` rows of ``value`` per image (its own plan), or a fixed count."""

    def __init__(self, num_tokens: int | None = None) -> None:
        self.num_tokens = num_tokens

    async def encode(self, image: bytes) -> torch.Tensor:
        n = self.num_tokens or peek_grid(image, VISION, ImageLimits()).num_tokens
        return torch.full((n, 4), float(len(image)))


def test_expand_placeholders_puts_each_span_in_place_of_its_placeholder():
    ids = [0, 5, PLACEHOLDER, 6, PLACEHOLDER, 7]
    assert expand_placeholders(ids, PLACEHOLDER, 1, [2, 3]) == [0, 5, 1, 1, 6, 1, 1, 1, 7]
    with pytest.raises(ValueError, match="2 image placeholders for 1 images"):
        expand_placeholders(ids, PLACEHOLDER, 1, [2])


def test_expand_plans_from_headers_and_embeddings_come_in_prompt_order():
    prompts = ImagePrompts(VISION, PLACEHOLDER, _Rows())
    a, b = png(100, 80, seed=1), png(42, 42, seed=2)
    ids, grids = prompts.expand([0, PLACEHOLDER, 9, PLACEHOLDER], [a, b])
    spans = [g.num_tokens for g in grids]
    assert ids == [0] + [VISION.image_token_id] * spans[0] + [9] + [VISION.image_token_id] * spans[1]
    rows = asyncio.run(prompts.embeddings([a, b], grids))
    assert rows.shape == (sum(spans), 4)
    assert rows[: spans[0]].eq(len(a)).all() and rows[spans[0] :].eq(len(b)).all()


def test_refusals_name_the_problem():
    image = png(60, 60)
    with pytest.raises(ValueError, match="no vision tower"):
        ImagePrompts(None, PLACEHOLDER, _Rows()).expand([PLACEHOLDER], [image])
    with pytest.raises(ValueError, match="the reason given"):
        ImagePrompts(VISION, PLACEHOLDER, None, refusal="the reason given").expand([PLACEHOLDER], [image])
    prompts = ImagePrompts(VISION, PLACEHOLDER, _Rows(), ImageLimits(max_images=2, max_pixels=50 * 50))
    with pytest.raises(ImageInputError, match="3 images in one request, over the limit of 2"):
        prompts.expand([PLACEHOLDER] * 3, [image] * 3)
    with pytest.raises(ImageInputError, match="3600 pixels, over the limit of 2500"):
        prompts.expand([PLACEHOLDER], [image])
    with pytest.raises(ImageInputError, match="not in a supported format"):
        prompts.expand([PLACEHOLDER], [b"GIF? no"])
    with pytest.raises(ValueError, match="1 image placeholders for 2 images"):
        prompts.expand([PLACEHOLDER], [png(30, 30), png(30, 30)])


def test_an_encoder_serving_another_model_is_unavailable_not_bad_input():
    prompts = ImagePrompts(VISION, PLACEHOLDER, _Rows(num_tokens=3))
    image = png(100, 80)
    _, grids = prompts.expand([PLACEHOLDER], [image])
    with pytest.raises(ImageEncoderUnavailable, match="returned 3 embeddings for image 0"):
        asyncio.run(prompts.embeddings([image], grids))


def test_a_served_engine_whose_worker_takes_no_embeddings_refuses_images_up_front():
    """A worker without ``set_images``: refused before anything is queued, not after."""
    from services.engine import LLM
    from services.engine.served_engine import ServedEngine

    class _RemoteLike:
        in_process, num_losses = False, 0

        def execute(self, *args):
            raise AssertionError("never stepped")

        def release(self, request_id):
            pass

    served = ServedEngine(LLM("tiny", worker=_RemoteLike()), served_model_name="tiny", replica="engine-0")
    assert served.images.vision is not None and served.images.encoder is None
    with pytest.raises(ValueError, match=r"its worker \(_RemoteLike\) takes no image embeddings"):
        served.images.expand([PLACEHOLDER], [png(60, 60)])


def test_a_served_engine_with_a_remote_worker_and_no_encoder_refuses_images_up_front():
    """A remote worker holds the weights, so the engine has no tower of its own: without a multimodal
    service it refuses images up front, naming the flag."""
    from services.engine import LLM
    from services.engine.served_engine import ServedEngine

    class _Remote:
        in_process, num_losses = False, 0

        def execute(self, *args):
            raise AssertionError("never stepped")

        def release(self, request_id):
            pass

        def set_images(self, request_id, prompt_token_ids, rows):
            raise AssertionError("never given rows")

    served = ServedEngine(LLM("tiny", worker=_Remote()), served_model_name="tiny", replica="engine-0")
    assert served.llm.source.model is None and served.images.encoder is None
    with pytest.raises(ValueError, match="no multimodal service.*--multimodal"):
        served.images.expand([PLACEHOLDER], [png(60, 60)])
