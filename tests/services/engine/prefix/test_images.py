"""Prefix caching with an image in the prefix (the tiny model's vision tower, batch-invariant mode): a second
turn resumes after the first one's image and gives the same bits as with the cache off; the same placeholder
tokens with another picture share nothing from the image on (the block hash names the image's content).

The rendered second turn diverges from the first prompt at its last token (the assistant turn's opening), so it
resumes at the first prompt's last full block (the snapshot policy's cut for re-rendered histories)."""

from __future__ import annotations

import pytest

from services.engine import LLM, SamplingParams
from tests.services.engine.test_llm_chat import data_url

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2, ignore_eos=True)
ENGINE = dict(block_size=16, max_num_batched_tokens=24, max_num_seqs=8, batch_invariant=True)

pytestmark = pytest.mark.usefixtures("pools_checked_after_every_step")  # conftest.py


def _ask(url: str) -> list[dict]:
    """The picture first, then a question long enough that the picture lies in full blocks."""
    text = "Look closely at this picture and tell me, in a few plain words, what you see in it and where."
    return [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}
    ]


def _turns(llm: LLM, url: str) -> list:
    first = llm.chat(_ask(url), GREEDY)[0]
    follow = _ask(url) + [
        {"role": "assistant", "content": first.text},
        {"role": "user", "content": "Describe it again, in other words please."},
    ]
    return [first, llm.chat(follow, GREEDY)[0]]


def test_a_second_turn_after_an_image_resumes_with_the_same_bits(chat_llm):
    off = LLM(source=chat_llm.source, enable_prefix_caching=False, **ENGINE)
    on = LLM(source=chat_llm.source, **ENGINE)
    image = on.source.config.vision.image_token_id
    url_a, url_b = data_url(100, 80, seed=11), data_url(100, 80, seed=12)
    turns_off, turns_on = _turns(off, url_a), _turns(on, url_a)
    for o, n in zip(turns_off, turns_on):
        assert (n.prompt_token_ids, n.token_ids, n.logprobs) == (o.prompt_token_ids, o.token_ids, o.logprobs)
    first, second = turns_on
    last_image = len(second.prompt_token_ids) - second.prompt_token_ids[::-1].index(image)
    assert second.num_cached_tokens == (len(first.prompt_token_ids) - 1) // 16 * 16 >= last_image
    # Picture B behind the same placeholders: its conversation gives the same bits, and its first turn shares
    # nothing of A's from the image's block on.
    first_image = second.prompt_token_ids.index(image)
    turns_b_off, turns_b_on = _turns(off, url_b), _turns(on, url_b)
    for o, n in zip(turns_b_off, turns_b_on):
        assert (n.token_ids, n.logprobs) == (o.token_ids, o.logprobs)
    assert turns_b_on[0].num_cached_tokens <= first_image // 16 * 16
    assert turns_b_on[1].num_cached_tokens >= last_image
