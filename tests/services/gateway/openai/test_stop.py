"""Stop strings end the request at the token that completes them, through the `openai` client."""

import openai
import pytest

from model.deepseek_v41.tokenizer import load_v41_tokenizer
from services.engine.sampling_params import SamplingParams
from tests.services.gateway.forcing import token_ids
from tests.services.gateway.support import wait_whole

pytestmark = pytest.mark.timeout(120)

TEXT = "one two three four five six seven"


def tokens_through(text: str, stop: str) -> int:
    """How many of the text's tokens it takes for the decoded text to hold ``stop``."""
    ids, tokenizer = token_ids(text), load_v41_tokenizer()
    return next(n for n in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:n]))


@pytest.mark.parametrize("stop", [["three"], ["e fo", "nothing"], "six"])
@pytest.mark.parametrize("include", [False, True])
def test_completion_stops_at_the_token(openai_client, forced, served, stop, include):
    first = stop if isinstance(stop, str) else stop[0]
    extra = {"include_stop_str_in_output": include, "ignore_eos": True}
    with forced.forcing(TEXT, end=False):
        plain = openai_client.completions.create(model="tiny", prompt="x", max_tokens=40, stop=stop, extra_body=extra)
        chunks = list(
            openai_client.completions.create(
                model="tiny",
                prompt="x",
                max_tokens=40,
                stop=stop,
                extra_body=extra,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
    cut = TEXT.index(first) + (len(first) if include else 0)
    assert plain.choices[0].text == TEXT[:cut] and plain.choices[0].finish_reason == "stop"
    assert plain.usage.completion_tokens == tokens_through(TEXT, first) == chunks[-1].usage.completion_tokens
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(deltas) == plain.choices[0].text
    if not include:
        assert not any(first in "".join(deltas[: i + 1]) for i in range(len(deltas)))
    wait_whole(served)  # the engine's request was ended at the match: its blocks are back


def test_chat_content_stops_too(openai_client, forced, served):
    ask = {"model": "tiny", "messages": [{"role": "user", "content": "Fruit?"}], "max_tokens": 40, "stop": ["Pears"]}
    with forced.forcing("Thinking.</think>Apples. Pears. Plums."):
        reply = openai_client.chat.completions.create(**ask)
        chunks = list(openai_client.chat.completions.create(**ask, stream=True))
    assert reply.choices[0].message.content == "Apples. " and reply.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Apples. "
    assert chunks[-1].choices[0].finish_reason == "stop"
    wait_whole(served)


def test_stop_limits(openai_client):
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        openai_client.completions.create(model="tiny", prompt="x", max_tokens=1, stop=["a", "b", "c", "d", "e"])
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(model="tiny", prompt="x", max_tokens=1, stop=[""])
    assert err.value.body["param"] == "stop"


def engine_takes_choices() -> bool:
    try:
        SamplingParams(n=2)
    except ValueError:
        return False
    return True


@pytest.mark.skipif(not engine_takes_choices(), reason="this engine serves one choice per request")
def test_n_choices_plain_and_streamed(openai_client, served):
    """Each choice has its own detokenizer and stop strings: streamed per index, its text equals the plain one."""
    extra = {"ignore_eos": True}
    plain = openai_client.completions.create(
        model="tiny", prompt="The sea", max_tokens=6, n=3, seed=5, extra_body=extra
    )
    streamed = list(
        openai_client.completions.create(
            model="tiny",
            prompt="The sea",
            max_tokens=6,
            n=3,
            seed=5,
            extra_body=extra,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert sorted(c.index for c in plain.choices) == [0, 1, 2]
    assert len({c.text for c in plain.choices}) > 1  # each choice its own seed stream
    for choice in plain.choices:
        text = "".join(c.choices[0].text for c in streamed if c.choices and c.choices[0].index == choice.index)
        assert text == choice.text
    assert plain.usage.completion_tokens == 18 == streamed[-1].usage.completion_tokens
    wait_whole(served)


@pytest.mark.skipif(not engine_takes_choices(), reason="this engine serves one choice per request")
def test_n_chat_choices_parse_apart(openai_client, served):
    messages = [{"role": "user", "content": "Hi"}]
    plain = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2, seed=9)
    streamed = list(
        openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=2, seed=9, stream=True)
    )
    for choice in plain.choices:
        deltas = [c.choices[0].delta for c in streamed if c.choices and c.choices[0].index == choice.index]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == choice.message.reasoning_content
    assert plain.usage.completion_tokens == 10
    wait_whole(served)


def test_skip_special_tokens_false_keeps_them(openai_client, forced):
    """The end token, forced into the middle with ignore_eos, is text only with skip_special_tokens false."""
    forced.forced = tuple(token_ids("Hi") + [1] + token_ids("there"))
    try:
        kept, skipped = (
            openai_client.completions.create(
                model="tiny",
                prompt="x",
                max_tokens=len(forced.forced),
                extra_body={"ignore_eos": True, "skip_special_tokens": skip},
            )
            for skip in (False, True)
        )
    finally:
        forced.forced = ()
    assert kept.choices[0].text == "Hi<｜end▁of▁sentence｜>there" and skipped.choices[0].text == "Hithere"
