"""The OpenAI contract's hard edges: masked logprobs are finite JSON,
deep nesting and nested NaN are 400s naming the place, Content-Type is enforced, 405 carries Allow,
unsupported OpenAI parameters are refused by name, logit_bias bans, and every error names its parameter."""

import json
import logging
import math

import pytest

from services.engine import SamplingParams
from services.gateway.frontend import MASKED_LOGPROB
from tests.services.gateway.support import post, raw_request
from tests.services.gateway.test_bad_input import OK

pytestmark = pytest.mark.timeout(60)


def strict_json(data: bytes):
    """json.loads as JSON.parse: NaN / Infinity are not JSON."""

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    return json.loads(data, parse_constant=refuse)


MASKED = {"model": "tiny", "prompt": "Hi", "max_tokens": 2, "logprobs": 2, "top_k": 1}  # logprobs under top_k


def test_masked_logprobs_are_finite_and_plain_json(served):
    status, data, _ = raw_request(
        served.http_url, "POST", "/v1/completions", json.dumps(MASKED).encode(), {"Content-Type": "application/json"}
    )
    assert status == 200, data
    logprobs = strict_json(data)["choices"][0]["logprobs"]
    values = [v for top in logprobs["top_logprobs"] for v in top.values()]
    assert MASKED_LOGPROB in values  # top_k=1 masks the runner-up: it reads as vLLM's -9999.0
    assert all(math.isfinite(v) for v in values + logprobs["token_logprobs"])


def test_masked_logprobs_stream_as_plain_json(served):
    body = json.dumps({**MASKED, "stream": True}).encode()
    status, data, _ = raw_request(
        served.http_url, "POST", "/v1/completions", body, {"Content-Type": "application/json"}
    )
    assert status == 200
    events = [line[6:] for line in data.decode().splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [strict_json(e.encode()) for e in events[:-1]]  # raises on -Infinity
    assert any(
        MASKED_LOGPROB in top.values()
        for c in chunks
        if c["choices"] and c["choices"][0]["logprobs"]
        for top in c["choices"][0]["logprobs"]["top_logprobs"]
    )


def test_masked_chat_logprobs_are_finite(served):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        "logprobs": True,
        "top_logprobs": 2,
        "top_k": 1,
    }
    code, reply, _ = post(served.http_url, "/v1/chat/completions", body)
    assert code == 200, reply
    tops = [t["logprob"] for c in reply["choices"][0]["logprobs"]["content"] for t in c["top_logprobs"]]
    assert MASKED_LOGPROB in tops and all(math.isfinite(v) for v in tops)


def test_deep_nesting_is_a_400_not_a_500(served, caplog):
    deep = b'{"model": "tiny", "prompt": "Hi", "x": ' + b"[" * 1000 + b"]" * 1000 + b"}"
    with caplog.at_level(logging.ERROR, logger="shinkai.gateway"):
        code, reply, _ = post(served.http_url, "/v1/completions", deep)
    assert code == 400 and "nested deeper than 64" in reply["error"]["message"], reply
    assert not [r for r in caplog.records if r.exc_info], "a refusal must not log a traceback"
    very_deep = b'{"x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"  # past the parser's own recursion limit
    code, reply, _ = post(served.http_url, "/v1/completions", very_deep)
    assert code == 400 and "nested deeper" in reply["error"]["message"], reply
    ok = {**OK, "x": json.loads("[" * 60 + "]" * 60)}  # within the limit: ignored as an unknown field
    assert post(served.http_url, "/v1/completions", ok)[0] == 200


@pytest.mark.parametrize(
    "body,path",
    [
        (b'{"model": "tiny", "messages": [{"role": "user", "content": NaN}]}', "messages[0].content"),
        (
            b'{"model": "tiny", "prompt": "Hi", "stream_options": {"include_usage": Infinity}}',
            "stream_options.include_usage",
        ),
        (b'{"model": "tiny", "prompt": [1, -Infinity]}', "prompt[1]"),
    ],
)
def test_non_finite_anywhere_names_its_path(served, body, path):
    endpoint = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    code, reply, _ = post(served.http_url, endpoint, body)
    assert code == 400, reply
    assert reply["error"]["param"] == path and path in reply["error"]["message"]


def test_a_prompt_equal_to_the_old_sentinel_is_served(served):
    code, reply, _ = post(served.http_url, "/v1/completions", {**OK, "prompt": "__shinkai_non_finite__"})
    assert code == 200, reply


@pytest.mark.parametrize(
    "content_type", [None, "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"]
)
def test_content_type_other_than_json_is_415(served, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    status, data, _ = raw_request(served.http_url, "POST", "/v1/completions", json.dumps(OK).encode(), headers)
    error = json.loads(data)["error"]
    assert status == 415 and "application/json" in error["message"] and error["code"] == "unsupported_media_type"


def test_json_with_a_charset_is_accepted(served):
    status, data, _ = raw_request(
        served.http_url,
        "POST",
        "/v1/completions",
        json.dumps(OK).encode(),
        {"Content-Type": "application/json; charset=utf-8"},
    )
    assert status == 200, data


@pytest.mark.parametrize(
    "method,path,allow",
    [
        ("GET", "/v1/completions", "POST"),
        ("PUT", "/v1/chat/completions", "POST"),
        ("POST", "/v1/models", "GET"),
        ("DELETE", "/health", "GET"),
    ],
)
def test_405_carries_allow(served, method, path, allow):
    status, data, headers = raw_request(served.http_url, method, path)
    assert status == 405 and headers.get("allow") == allow, (headers, data)
    assert json.loads(data)["error"]["code"] == "method_not_allowed"


UNSUPPORTED = [
    ({"response_format": {"type": "xml"}}, "response_format"),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
        "response_format",
    ),
    ({"best_of": 2}, "best_of"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"suffix": "tail"}, "suffix"),
    ({"guided_json": {"type": "object", "not": {"required": ["a"]}}}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"structural_tag": "{}"}, "structural_tag"),
]


@pytest.mark.parametrize("extra,param", UNSUPPORTED, ids=[u[1] + str(i) for i, u in enumerate(UNSUPPORTED)])
def test_unsupported_parameters_are_refused_by_name(served, extra, param):
    code, reply, _ = post(served.http_url, "/v1/completions", {**OK, **extra})
    assert code == 400 and reply["error"]["param"] == param and param in reply["error"]["message"], reply


def test_no_op_values_of_unsupported_parameters_pass(served):
    body = {
        **OK,
        "response_format": {"type": "text"},
        "best_of": 1,
        "n": 1,
        "stop": [],
        "presence_penalty": 0,
        "logit_bias": {"5": 0},
        "user": "u",
        "some_future_field": 1,
    }
    code, reply, _ = post(served.http_url, "/v1/completions", body)
    assert code == 200, reply


def test_unknown_fields_are_logged(served, caplog):
    with caplog.at_level(logging.WARNING, logger="shinkai.gateway"):
        assert post(served.http_url, "/v1/completions", {**OK, "frobnicate": 1})[0] == 200
    assert any("frobnicate" in r.getMessage() for r in caplog.records)


def test_logit_bias_ban_is_applied(served, reference_llm):
    """Greedy picks some token t; banning t with -100 must make the greedy pick another token."""
    body = {"model": "tiny", "prompt": [0, 5, 6], "max_tokens": 1, "temperature": 0, "logprobs": 0}
    code, reply, _ = post(served.http_url, "/v1/completions", body)
    assert code == 200
    first = reply["choices"][0]["logprobs"]["tokens"][0]
    greedy = reference_llm.generate([[0, 5, 6]], SamplingParams(max_tokens=1, temperature=0))[0].token_ids[0]
    assert reference_llm.tokenizer.decode([greedy], skip_special_tokens=False) == first
    code, reply, _ = post(served.http_url, "/v1/completions", {**body, "logit_bias": {str(greedy): -100}})
    assert code == 200
    assert reply["choices"][0]["logprobs"]["tokens"][0] != first


def test_logit_bias_adds_to_the_logits(served, reference_llm):
    """A +100 bias on a token the model ranks low makes it the greedy pick; its logprob is that of the
    biased distribution, equal to the offline engine's with the same bias."""
    prompt = [0, 5, 6]
    low = reference_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=20))[0]
    target = low.top_logprobs[0][-1][0]  # the 20th-ranked token
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0,
        "logprobs": 0,
        "logit_bias": {str(target): 100},
    }
    code, reply, _ = post(served.http_url, "/v1/completions", body)
    assert code == 200
    want = reference_llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logit_bias={target: 100.0}))[0]
    assert want.token_ids == [target]
    assert reply["choices"][0]["logprobs"]["tokens"][0] == reference_llm.tokenizer.decode(
        [target], skip_special_tokens=False
    )
    assert reply["choices"][0]["logprobs"]["token_logprobs"][0] == want.logprobs[0]


@pytest.mark.parametrize(
    "bias,word",
    [
        ({"999999": -100}, "vocabulary"),
        ({"x": -100}, "token ids"),
        ({"5": -101}, "-100 to 100"),
        ({"5": "ban"}, "-100 to 100"),
    ],
)
def test_bad_logit_bias_names_it(served, bias, word):
    code, reply, _ = post(served.http_url, "/v1/completions", {**OK, "logit_bias": bias})
    assert code == 400 and reply["error"]["param"] == "logit_bias" and word in reply["error"]["message"], reply


@pytest.mark.parametrize(
    "body,param",
    [
        ({**OK, "top_k": 2**70}, "top_k"),
        ({**OK, "seed": 2**64}, "seed"),
        ({**OK, "stop_token_ids": [2**70]}, "stop_token_ids"),
        ({**OK, "stop_token_ids": [999999]}, "stop_token_ids"),
        ({**OK, "logprobs": 21}, "logprobs"),
        ({**OK, "prompt": [0, 999999]}, "prompt"),
        ({**OK, "max_tokens": 4096}, "prompt"),
        (
            {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
    ],
)
def test_every_error_names_its_parameter(served, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    code, reply, _ = post(served.http_url, path, body)
    assert code == 400, reply
    assert reply["error"]["param"] == param, reply
    assert "Value out of range" not in reply["error"]["message"]
