"""The OpenAI-compatible HTTP API through the `openai` client and raw HTTP."""

import json
import re
import time
import urllib.request

import openai
import pytest

from services.engine import SamplingParams
from tests.openai_streams import concurrent_completion_streams
from tests.services.gateway.support import wait_whole

pytestmark = pytest.mark.timeout(120)


def test_completion_text_equals_llm_generate(openai_client, reference_llm):
    resp = openai_client.completions.create(model="tiny", prompt="Hello", max_tokens=4, seed=11)
    expected = reference_llm.generate("Hello", SamplingParams(max_tokens=4, seed=11))[0]
    assert resp.choices[0].text == expected.text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 4 and resp.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_the_response_id_carries_the_request_id(openai_client):
    ids = [openai_client.completions.create(model="tiny", prompt="Hi", max_tokens=1).id for _ in range(2)]
    assert all(re.fullmatch(r"cmpl-req-[0-9a-f]{32}", i) for i in ids), ids  # "cmpl-" + the gateway's request_id
    assert ids[0] != ids[1]


def test_x_request_id_names_the_request_and_comes_back(openai_client):
    raw = openai_client.completions.with_raw_response.create(
        model="tiny", prompt="Hi", max_tokens=1, extra_headers={"X-Request-Id": "my-run-7"}
    )
    assert raw.headers["x-request-id"] == "my-run-7"
    assert re.fullmatch(r"cmpl-req-[0-9a-f]{32}", raw.parse().id)  # the request_id stays the gateway's
    plain = openai_client.completions.with_raw_response.create(model="tiny", prompt="Hi", max_tokens=1)
    assert plain.headers["x-request-id"] == plain.parse().id.removeprefix("cmpl-")  # none given: the request_id
    with openai_client.completions.with_streaming_response.create(
        model="tiny", prompt="Hi", max_tokens=1, stream=True, extra_headers={"X-Request-Id": "s-1"}
    ) as streamed:
        assert streamed.headers["x-request-id"] == "s-1"
    with pytest.raises(openai.BadRequestError, match="X-Request-Id is 257 bytes"):
        openai_client.completions.create(
            model="tiny", prompt="Hi", max_tokens=1, extra_headers={"X-Request-Id": "x" * 257}
        )


def test_streamed_completion_equals_the_plain_one(openai_client):
    plain = openai_client.completions.create(model="tiny", prompt="The sea", max_tokens=4, seed=3)
    chunks = list(
        openai_client.completions.create(
            model="tiny", prompt="The sea", max_tokens=4, seed=3, stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 4


def test_chat_plain_and_streamed(openai_client, reference_llm, served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    plain = openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, seed=5)
    chunks = list(
        openai_client.chat.completions.create(model="tiny", messages=messages, max_tokens=3, seed=5, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    # Thinking is on by default: the random model never writes </think>, so all it writes is reasoning.
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == plain.choices[0].message.reasoning_content
    assert not plain.choices[0].message.content
    assert plain.choices[0].finish_reason == "length" and plain.usage.completion_tokens == 3
    # The prompt is deepseek-recipe's rendering: system token, the user turn, then <think>.
    ids = served.server.chat.render({"messages": messages}).token_ids
    assert ids[:2] == [0, 128799] and ids[-1] == 128821 and plain.usage.prompt_tokens == len(ids)
    expected = reference_llm.generate([ids], SamplingParams(max_tokens=3, seed=5))[0]
    assert "</think>" not in expected.text  # (else the split below would differ)
    assert plain.choices[0].message.reasoning_content == expected.text.lstrip("\n")


def test_token_id_prompt_and_logprobs(openai_client, reference_llm):
    resp = openai_client.completions.create(model="tiny", prompt=[0, 19923], max_tokens=2, seed=1, logprobs=2)
    expected = reference_llm.generate([[0, 19923]], SamplingParams(max_tokens=2, seed=1, logprobs=2))[0]
    assert resp.choices[0].logprobs.token_logprobs == expected.logprobs
    assert len(resp.choices[0].logprobs.top_logprobs) == 2


def test_models_health_metrics(openai_client, served):
    assert [m.id for m in openai_client.models.list().data] == ["tiny"]
    with urllib.request.urlopen(served.http_url + "/health") as r:
        assert json.load(r) == {"status": "ok"}
    openai_client.completions.create(model="tiny", prompt="Hi", max_tokens=1)
    with urllib.request.urlopen(served.http_url + "/metrics") as r:
        text = r.read().decode()
    assert "shinkai_time_to_first_token_seconds_count" in text
    assert 'shinkai_requests_finished_total{reason="length"}' in text
    assert "shinkai_engine_free_blocks" in text


def test_client_disconnect_mid_stream_aborts_and_returns_blocks(served):
    body = json.dumps(
        {"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    ).encode()
    req = urllib.request.Request(
        served.http_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
    )
    before = served.server.metrics.finished.labels(reason="abort")._value.get()
    resp = urllib.request.urlopen(req, timeout=60)
    assert resp.readline().startswith(b"data: ")  # the stream is live
    resp.close()  # the client goes away
    wait_whole(served)
    assert served.server.metrics.finished.labels(reason="abort")._value.get() == before + 1


def test_client_disconnect_during_a_plain_request_aborts_it(served):
    import http.client
    from urllib.parse import urlparse

    url = urlparse(served.http_url)
    before = served.server.metrics.finished.labels(reason="abort")._value.get()
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps({"model": "tiny", "prompt": "Hello", "max_tokens": 1000, "ignore_eos": True}),
        {"Content-Type": "application/json"},
    )
    deadline = time.monotonic() + 30
    while served.server.engine.num_unfinished() == 0:  # it is running
        assert time.monotonic() < deadline
        time.sleep(0.02)
    conn.close()  # the client goes away without reading the answer
    wait_whole(served, timeout=20)  # 1000 tokens would take far longer
    assert served.server.metrics.finished.labels(reason="abort")._value.get() == before + 1


def test_concurrent_streams_all_finish_with_their_token_counts(served):
    results = concurrent_completion_streams(served.http_url + "/v1")
    assert all(got == want and reason == "length" for want, got, reason in results), results
    wait_whole(served)
