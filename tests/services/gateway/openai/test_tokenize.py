"""vLLM's /tokenize, /detokenize and /version, and OpenAI's /v1/models/{id}."""

import json
import tomllib
from pathlib import Path

import openai
import pytest

from tests.services.gateway.support import raw_request

pytestmark = pytest.mark.timeout(60)
JSON = {"Content-Type": "application/json"}


def post(served, path, body):
    status, data, _ = raw_request(served.http_url, "POST", path, json.dumps(body).encode(), JSON)
    return status, json.loads(data)


def test_tokenize_a_prompt_as_a_completion_encodes_it(served):
    status, reply = post(served, "/tokenize", {"model": "tiny", "prompt": "Hello world", "return_token_strs": True})
    expected = served.server.llm.encode("Hello world")
    assert status == 200 and reply["tokens"] == expected and reply["count"] == len(expected)
    assert reply["max_model_len"] == served.server.frontend.info.max_model_len
    assert len(reply["token_strs"]) == len(expected)
    status, back = post(served, "/detokenize", {"model": "tiny", "tokens": expected[1:]})
    assert status == 200 and back == {"prompt": "Hello world"}


def test_tokenize_a_chat_as_a_chat_renders_it(served):
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    status, reply = post(
        served, "/tokenize", {"model": "tiny", "messages": messages, "chat_template_kwargs": {"thinking": False}}
    )
    rendered = served.server.chat.render(
        {"messages": [{"role": "system", "content": "Be brief."}, messages[1]], "thinking": {"type": "disabled"}}
    )
    assert status == 200 and reply["tokens"] == rendered.token_ids and reply["token_strs"] is None


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{x}}"}, "chat_template"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "ultra"},
            "reasoning_effort",
        ),
    ],
)
def test_bad_bodies_are_400_naming_the_field(served, path, body, param):
    status, reply = post(served, path, body)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_version_and_model_by_id(served, openai_client):
    status, data, _ = raw_request(served.http_url, "GET", "/version")
    pyproject = tomllib.loads((Path(__file__).resolve().parents[4] / "pyproject.toml").read_text())
    assert status == 200 and json.loads(data) == {"version": pyproject["project"]["version"]}
    assert openai_client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("gpt-9")
