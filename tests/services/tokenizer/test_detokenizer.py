"""Incremental detokenization: deltas concatenate to the full decode and never split a UTF-8 character."""

import random

import pytest

from model.deepseek_v41.tokenizer import load_v41_tokenizer
from services.tokenizer.detokenizer import REPLACEMENT, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_v41_tokenizer()


def stream(tokenizer, ids, step=1):
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(ids[i : i + step]) for i in range(0, len(ids), step)]
    return deltas, detok.finish()


@pytest.mark.parametrize("text", ["héllo 世界 🎉🎉 ok", "🎉", "日本語のテキスト、絵文字👩‍👩‍👧 mixed"])
def test_multibyte_characters_are_never_split(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    # The emoji needs several byte-level tokens, each of which decodes alone to U+FFFD.
    assert any(REPLACEMENT in tokenizer.decode([i]) for i in ids) or len(ids) == 1
    deltas, tail = stream(tokenizer, ids)
    assert "".join(deltas) + tail == text
    assert not any(REPLACEMENT in d for d in deltas), deltas
    assert tail == ""


def test_random_ids_concatenate_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.get_vocab_size()) for _ in range(rng.randrange(1, 12))]
        deltas, tail = stream(tokenizer, ids, step=rng.choice([1, 2, 3]))
        assert "".join(deltas) + tail == tokenizer.decode(ids, skip_special_tokens=True)


def test_an_incomplete_character_is_held_until_finish(tokenizer):
    ids = tokenizer.encode("🎉", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:1]) == ""  # the first byte alone is not a character
    assert detok.finish() == tokenizer.decode(ids[:1])  # finish flushes what the stream really holds
