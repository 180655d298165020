"""``LLM.chat`` offline with ``image_url`` parts on the tiny model: the prompt is the recipe's rendering with
each image's placeholder expanded to its span, greedy tokens follow the full forward with the image
embeddings (exactly, in batch-invariant mode), images move the output, and each bad image or URL is refused
naming the problem with nothing queued."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from model.deepseek_v41.vision import span_length
from services.engine import SamplingParams
from services.engine.images.prompt import expand_images
from services.multimodal.preprocess import ImageInputError, ImageLimits, prepare_image

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


def data_url(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(out.getvalue()).decode()


def ask(*urls: str, text: str = "What is in the picture?") -> list[dict]:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return [{"role": "user", "content": parts}]


@pytest.fixture
def llm(chat_llm):
    return chat_llm


def _pools_whole(llm):
    s = llm.stats()
    assert s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots
    assert s.num_waiting == s.num_running == 0


def test_chat_with_an_image_follows_the_full_forward_exactly(llm):
    url = data_url(100, 80)
    out = llm.chat(ask(url), GREEDY)[0]
    model, vision = llm.source.model, llm.source.config.vision
    grid = prepare_image(base64.b64decode(url.split(",", 1)[1]), vision, ImageLimits()).grid
    prompt = out.prompt_token_ids
    assert prompt.count(vision.image_token_id) == span_length(grid.rows, grid.cols) == 10
    first = prompt.index(vision.image_token_id)
    assert prompt[first : first + 10] == [vision.image_token_id] * 10  # one contiguous span
    ids, rows = expand_images(
        llm._chat.render({"messages": ask(url)}).token_ids, [url], llm.tokenizer.token_to_id("<｜image｜>"), model
    )
    assert ids == prompt and rows.shape == (10, llm.source.config.hidden_size)
    from model.batch_invariant import batch_invariant

    with torch.no_grad(), batch_invariant():  # teacher-forced: each output token is the argmax before it
        logits = model(torch.tensor([prompt + out.token_ids[:-1]]), image_rows=rows)[0, len(prompt) - 1 :]
    assert out.token_ids == logits.argmax(-1).tolist()
    _pools_whole(llm)
    assert len(llm.engine.worker.runner.images) == 0  # released with the request


def test_the_image_moves_the_answer_and_text_only_chat_equals_generate(llm):
    with_a, with_b, text_only = llm.chat(
        [ask(data_url(100, 80, seed=1)), ask(data_url(100, 80, seed=2)), ask(text="What is in the picture?")], GREEDY
    )
    assert with_a.prompt_token_ids == with_b.prompt_token_ids
    assert with_a.token_ids != with_b.token_ids or with_a.logprobs != with_b.logprobs
    assert llm.generate(text_only.prompt_token_ids, GREEDY)[0].token_ids == text_only.token_ids
    _pools_whole(llm)


@pytest.mark.parametrize(
    "urls, error, message",
    [
        ([data_url(30, 30)[:60]], ImageInputError, "corrupt|truncated|base64|supported"),
        (["data:image/png;base64,!!!!"], ValueError, "base64"),
        ([data_url(30, 30, fmt="TIFF")], ValueError, "unsupported image"),
        ([data_url(20, 20)] * 9, ImageInputError, "9 images in one request, over the limit of 8"),
        (["file:///etc/passwd"], ValueError, "image_url"),
        (["http://127.0.0.1:9/none.png"], ImageInputError, "could not be fetched"),
    ],
)
def test_bad_images_are_refused_and_queue_nothing(llm, urls, error, message):
    with pytest.raises(error, match=message):
        llm.chat(ask(*urls), GREEDY)
    _pools_whole(llm)


def test_a_raw_prompt_holding_the_placeholder_is_refused(llm):
    with pytest.raises(ValueError, match="image placeholder id 129264 without an image"):
        llm.generate([0, 5, 129264, 7], GREEDY)
