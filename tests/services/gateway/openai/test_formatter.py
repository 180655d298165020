"""Logprobs as OpenAI and vLLM clients read them: a completion's ``text_offset`` (each token's place in the
choice's text, plain, echoed and streamed alike), a chat token's ``bytes``, and a streamed chat chunk's logprobs
on the chunk that carries those tokens' text (never on the role chunk)."""

import pytest

from services.gateway.openai.formatter import text_offsets
from tests.services.gateway.forcing import token_ids

pytestmark = pytest.mark.timeout(120)

TEXT = "The deep sea is dark and cold."
USER = [{"role": "user", "content": "Describe the sea."}]


def test_text_offsets_place_each_token_where_its_string_starts():
    assert text_offsets("Hello world", ["Hello", " world"], 7) == [7, 12]
    # A special token the text leaves out has no width; a split UTF-8 character's pieces (U+FFFD) sit at its
    # start, and the next token places the rest again.
    assert text_offsets("Hi é ok", ["<｜begin▁of▁sentence｜>", "Hi", " \ufffd", "\ufffd", " ok"], 0) == [0, 0, 2, 2, 4]
    assert text_offsets("", ["<｜end▁of▁sentence｜>"], 3) == [3]


def test_completion_text_offsets_plain_streamed_and_echoed(openai_client, forced):
    with forced.forcing(TEXT):
        plain = openai_client.completions.create(model="tiny", prompt="Sea:", max_tokens=20, logprobs=1)
        chunks = list(
            openai_client.completions.create(model="tiny", prompt="Sea:", max_tokens=20, logprobs=1, stream=True)
        )
        echoed = openai_client.completions.create(model="tiny", prompt="Sea:", max_tokens=20, logprobs=1, echo=True)
    choice = plain.choices[0]
    assert choice.text == TEXT
    tokens, offsets = choice.logprobs.tokens, choice.logprobs.text_offset
    assert len(offsets) == len(tokens) and offsets[0] == 0
    for token, offset in zip(tokens[:-1], offsets):  # the last token is the end token, outside the text
        assert choice.text[offset : offset + len(token)] == token
    streamed = [o for c in chunks for ch in c.choices if ch.logprobs for o in ch.logprobs.text_offset]
    assert streamed == offsets
    # echo: the prompt leads (BOS at 0 with no width, "Sea" at 0, ":" at 3), then the text at the prompt's end
    e = echoed.choices[0]
    assert e.text == "Sea:" + TEXT
    assert e.logprobs.text_offset[:3] == [0, 0, 3]
    assert e.logprobs.text_offset[3:] == [4 + o for o in offsets]


def test_chat_logprobs_carry_bytes_and_ride_with_their_text(openai_client, forced):
    with forced.forcing(TEXT):
        chunks = list(
            openai_client.chat.completions.create(
                model="tiny",
                messages=USER,
                max_tokens=20,
                logprobs=True,
                top_logprobs=2,
                stream=True,
                reasoning_effort="none",
            )
        )
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].logprobs is None
    content = ""
    for chunk in chunks:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        if choice.logprobs is None:
            continue
        for entry in choice.logprobs.content:
            assert entry.bytes == list(entry.token.encode())
            # a whole-character token's bytes are its string's UTF-8 (a piece of one shows U+FFFD: next test)
            assert all("\ufffd" in top.token or top.bytes == list(top.token.encode()) for top in entry.top_logprobs)
        if choice.finish_reason is None:  # plain text with no markers: each chunk's text is its tokens'
            assert choice.delta.content == "".join(e.token for e in choice.logprobs.content)
    assert content == TEXT


def test_return_token_ids_plain_and_streamed(openai_client, forced):
    """vLLM's return_token_ids: a completion choice carries its prompt's and its own ids; a chat body its prompt's
    and each choice its own; streamed, every chunk its new ids and the first chunk the prompt's."""
    extra = {"return_token_ids": True}
    with forced.forcing(TEXT) as ids:
        plain = openai_client.completions.create(model="tiny", prompt="Sea:", max_tokens=20, extra_body=extra)
        chunks = list(
            openai_client.completions.create(model="tiny", prompt="Sea:", max_tokens=20, stream=True, extra_body=extra)
        )
        chat = openai_client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, extra_body=extra)
        chat_chunks = list(
            openai_client.chat.completions.create(
                model="tiny", messages=USER, max_tokens=20, stream=True, extra_body=extra
            )
        )
    prompt_ids = [0, *token_ids("Sea:")]  # BOS, then the text
    choice = plain.choices[0].model_extra
    assert choice["token_ids"] == ids and choice["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == ids
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c.choices[0].model_extra for c in chunks[1:])
    assert chat.choices[0].model_extra["token_ids"] == ids
    assert len(chat.model_extra["prompt_token_ids"]) == chat.usage.prompt_tokens
    streamed = [t for c in chat_chunks for ch in c.choices for t in ch.model_extra.get("token_ids") or []]
    assert streamed == ids
    assert chat_chunks[0].model_extra["prompt_token_ids"] == chat.model_extra["prompt_token_ids"]
    assert all("prompt_token_ids" not in c.model_extra for c in chat_chunks[1:])


def test_chat_logprob_bytes_join_a_character_split_over_tokens(openai_client, forced):
    """Each token's own bytes (OpenAI's meaning): where the pieces of 🐙 decode only to U+FFFD each, their bytes
    still join into the character."""
    text = "Octopus 🐙 deep"
    with forced.forcing(text):
        reply = openai_client.chat.completions.create(
            model="tiny", messages=USER, max_tokens=20, logprobs=True, reasoning_effort="none"
        )
    entries = reply.choices[0].logprobs.content[:-1]  # the last is the end token
    assert any(e.token == "\ufffd" for e in entries)  # the character is split over tokens
    assert b"".join(bytes(e.bytes) for e in entries) == text.encode()
