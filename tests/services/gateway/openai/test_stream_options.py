"""stream_options: include_usage, vLLM's continuous_usage_stats (usage on every chunk), include_obfuscation
accepted, and stream_options without stream refused by name, as OpenAI and vLLM do."""

import json

import openai
import pytest

from services.gateway import errors
from services.gateway.openai.stream_options import StreamOptions, stream_options

pytestmark = pytest.mark.timeout(120)


def test_parsed_options():
    assert stream_options({}) == StreamOptions(False, False, False)
    assert stream_options({"stream": True, "stream_options": {"include_usage": True}}) == StreamOptions(
        True, True, False
    )
    both = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    assert stream_options(both) == StreamOptions(True, True, True)
    # continuous usage needs include_usage, as in vLLM
    alone = {"stream": True, "stream_options": {"continuous_usage_stats": True, "include_obfuscation": False}}
    assert stream_options(alone) == StreamOptions(True, False, False)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
        ({"stream": True, "stream_options": ["include_usage"]}, "stream_options"),
        ({"stream": 1}, "stream"),
    ],
)
def test_refusals_name_the_field(body, param):
    with pytest.raises(errors.ApiError) as err:
        stream_options(body)
    assert err.value.openai_body()["error"]["param"] == param


def test_stream_options_without_stream_is_a_400(openai_client):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(
            model="tiny", prompt="Hi", max_tokens=2, stream_options={"include_usage": True}
        )
    assert err.value.body["param"] == "stream_options"


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(openai_client, chat):
    options = {"include_usage": True, "continuous_usage_stats": True}
    common = {"model": "tiny", "max_tokens": 4, "seed": 2, "stream": True, "n": 2}
    if chat:
        chunks = list(
            openai_client.chat.completions.create(
                messages=[{"role": "user", "content": "Hi"}], stream_options=options, **common
            )
        )
    else:
        chunks = list(openai_client.completions.create(prompt="Hi", stream_options=options, **common))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 8
    so_far = {0: 0, 1: 0}
    for chunk in body:
        assert chunk.usage is not None, json.dumps(chunk.model_dump())
        index = chunk.choices[0].index
        assert chunk.usage.completion_tokens >= so_far[index]  # each choice's count so far, never going back
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        so_far[index] = chunk.usage.completion_tokens
    assert so_far == {0: 4, 1: 4}
