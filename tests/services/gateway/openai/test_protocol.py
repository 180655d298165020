"""Request bodies to `GenerateArgs`: lengths, the engine's sampling fields, stop strings, chat options."""

import json

import pytest

from services.engine.sampling_params import SamplingParams
from services.gateway.errors import ApiError
from services.gateway.openai.protocol import COMPLETION_MAX_TOKENS, ENGINE_FIELDS, parse_chat, parse_completion
from tests.services.gateway.support import raw_request

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "tiny", "prompt": "Hi"}


def test_chat_without_max_tokens_leaves_it_unset_and_completions_keep_16():
    assert parse_chat(dict(CHAT), 4096).args.params.max_tokens is None
    assert parse_chat(dict(CHAT, max_completion_tokens=7), 4096).args.params.max_tokens == 7
    assert parse_chat(dict(CHAT, max_tokens=5), 4096).args.params.max_tokens == 5
    assert parse_completion(dict(COMPLETION), 4096).args.params.max_tokens == COMPLETION_MAX_TOKENS == 16


ENGINE_VALUES = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.25,
    "repetition_penalty": 1.2,
    "min_tokens": 2,
    "min_p": 0.05,
}


@pytest.mark.parametrize("name", sorted(ENGINE_FIELDS))
def test_engine_fields_reach_sampling_params_or_are_refused_by_name(name):
    body = dict(COMPLETION, **{name: ENGINE_VALUES[name]})
    if name in SamplingParams.__dataclass_fields__:
        assert getattr(parse_completion(body, 4096).args.params, name) == ENGINE_VALUES[name]
        assert (
            getattr(parse_chat(dict(CHAT, **{name: ENGINE_VALUES[name]}), 4096).args.params, name)
            == ENGINE_VALUES[name]
        )
    else:  # an engine without the field: refused, never dropped
        with pytest.raises(ApiError) as err:
            parse_completion(body, 4096)
        assert err.value.param == name


def test_stop_and_request_id_and_developer_role():
    parsed = parse_chat(
        dict(
            CHAT,
            stop="END",
            include_stop_str_in_output=True,
            request_id="mine",
            messages=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        ),
        4096,
    )
    assert parsed.args.stop == ("END",) and parsed.args.include_stop_str_in_output
    assert parsed.args.client_request_id == "mine"
    assert parsed.args.chat_body["messages"][0]["role"] == "system"


def test_thinking_switches_agree():
    body = dict(CHAT, chat_template_kwargs={"thinking": True}, thinking={"type": "disabled"})
    with pytest.raises(ApiError, match="both on and off"):
        parse_chat(body, 4096)
    on = parse_chat(dict(CHAT, chat_template_kwargs={"enable_thinking": True}), 4096)
    assert on.args.chat_body["thinking"] == {"type": "enabled"}


def test_a_prompt_over_the_context_is_openais_400(served):
    info = served.server.frontend.info
    body = dict(CHAT, messages=[{"role": "user", "content": "word " * (info.max_model_len + 10)}], max_tokens=1)
    status, data, _ = raw_request(
        served.http_url, "POST", "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    error = json.loads(data)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "messages", error
    assert f"maximum context length is {info.max_model_len} tokens" in error["message"]


def test_priority_reaches_the_generation_or_is_refused_by_name():
    from services.gateway.frontend import GenerateArgs

    body = dict(COMPLETION, priority=-3)
    if "priority" in GenerateArgs.__dataclass_fields__:
        assert parse_completion(body, 4096).args.priority == -3
        assert parse_chat(dict(CHAT, priority=-3), 4096).args.priority == -3
    else:
        with pytest.raises(ApiError) as err:
            parse_completion(body, 4096)
        assert err.value.param == "priority"
