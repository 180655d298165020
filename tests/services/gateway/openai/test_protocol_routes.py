"""OpenAI Responses and Anthropic Messages through their own unmodified clients, the model's output forced."""

import json
import urllib.error
import urllib.request

import anthropic
import pytest

from services.engine.finish_reason import FinishReason
from services.engine.service import Delta
from tests.services.gateway.support import wait_whole

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def anthropic_client(served):
    """The unmodified `anthropic` client of the served gateway's Messages API."""
    return anthropic.Anthropic(base_url=served.http_url, api_key="unused", max_retries=0, timeout=60)


def test_responses_plain_and_streamed(openai_client, forced):
    with forced.forcing("Short thought.</think>Hello from Shinkai."):
        plain = openai_client.responses.create(model="tiny", input="Say hello", max_output_tokens=40)
        events = list(
            openai_client.responses.create(model="tiny", input="Say hello", max_output_tokens=40, stream=True)
        )
    assert plain.output_text == "Hello from Shinkai." and plain.status == "completed"
    reasoning = [item for item in plain.output if item.type == "reasoning"]
    assert reasoning and reasoning[0].content[0].text == "Short thought."
    assert plain.usage.output_tokens > 0 and plain.usage.input_tokens > 0
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == plain.output_text and events[-1].type == "response.completed"
    assert events[-1].response.output_text == plain.output_text


def test_anthropic_messages_plain_and_streamed(anthropic_client, forced):
    messages = [{"role": "user", "content": "Say hello"}]
    with forced.forcing("Thinking briefly.</think>Hello, human."):
        reply = anthropic_client.messages.create(model="tiny", max_tokens=40, messages=messages, system="Be kind.")
        with anthropic_client.messages.stream(
            model="tiny", max_tokens=40, messages=messages, system="Be kind."
        ) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    blocks = {b.type: b for b in reply.content}
    assert blocks["thinking"].thinking == "Thinking briefly." and blocks["text"].text == "Hello, human."
    assert reply.stop_reason == "end_turn" and reply.usage.output_tokens > 0
    assert text == "Hello, human." and final.content[-1].text == "Hello, human."


def test_bad_protocol_bodies_are_400(anthropic_client):
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model="tiny", max_tokens=5, messages=[])
    with pytest.raises(anthropic.NotFoundError):
        anthropic_client.messages.create(model="claude-x", max_tokens=5, messages=[{"role": "user", "content": "x"}])


def test_responses_function_call(openai_client, forced):
    from tests.services.gateway.openai.test_chat_reasoning import dsml

    tool = {
        "type": "function",
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    with forced.forcing("Check.</think>" + dsml(("get_weather", {"city": "Oslo"}))):
        reply = openai_client.responses.create(
            model="tiny", input="Weather in Oslo?", tools=[tool], max_output_tokens=80
        )
    (call,) = [item for item in reply.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}


def test_anthropic_stop_sequences_end_the_request(anthropic_client, served, forced):
    ask = {
        "model": "tiny",
        "max_tokens": 40,
        "messages": [{"role": "user", "content": "x"}],
        "stop_sequences": ["Beta"],
    }
    with forced.forcing("Think.</think>Alpha. Beta. Gamma."):
        reply = anthropic_client.messages.create(**ask)
        with anthropic_client.messages.stream(**ask) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    assert (
        (reply.stop_reason, reply.stop_sequence)
        == ("stop_sequence", "Beta")
        == (final.stop_reason, final.stop_sequence)
    )
    assert reply.content[-1].text == "Alpha. " == text
    wait_whole(served)


def test_requests_are_counted_under_their_endpoint(anthropic_client, openai_client, served, forced):
    """After the tests above, both endpoints' requests appear in /metrics under their own endpoint label."""
    import urllib.request

    anthropic_client.messages.create(model="tiny", max_tokens=1, messages=[{"role": "user", "content": "x"}])
    openai_client.responses.create(model="tiny", input="x", max_output_tokens=1)
    with urllib.request.urlopen(served.http_url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    assert 'endpoint="messages"' in text and 'endpoint="responses"' in text


class _Ending:
    """An engine stream that passes its first delta, then aborts the request and ends with ``reason``."""

    def __init__(self, inner, reason: FinishReason) -> None:
        self.inner, self.reason, self.num_prompt_tokens = inner, reason, inner.num_prompt_tokens
        self.seen: Delta | None = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> Delta:
        if self.seen is None:
            self.seen = await self.inner.__anext__()
            if self.seen.finish_reason is None:
                return self.seen
        self.inner.close()
        return Delta([], [], None, self.seen.num_output_tokens, finish_reason=self.reason, last=True)

    def close(self) -> None:
        self.inner.close()


class _EndingEngine:
    def __init__(self, inner, reason: FinishReason) -> None:
        self.inner, self.reason = inner, reason

    async def submit(self, *args, **kwargs):
        return _Ending(await self.inner.submit(*args, **kwargs), self.reason)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.fixture
def ending(served):
    frontend = served.server.frontend
    inner = frontend.engine

    def end_with(reason: FinishReason) -> None:
        frontend.engine = _EndingEngine(inner, reason)

    yield end_with
    frontend.engine = inner


@pytest.mark.parametrize(
    "reason, status",
    [(FinishReason.ERROR, "failed"), (FinishReason.PREEMPTED, "failed"), (FinishReason.ABORT, "incomplete")],
)
def test_an_engine_ending_is_reported_by_responses(openai_client, served, ending, reason, status):
    """Not a normal stop: status "failed" with a server_error, or "incomplete" for an abort; streamed, the
    terminal event is response.failed / response.incomplete."""
    ending(reason)
    plain = openai_client.responses.create(model="tiny", input="Say hello", max_output_tokens=40)
    events = list(openai_client.responses.create(model="tiny", input="Say hello", max_output_tokens=40, stream=True))
    assert plain.status == status and events[-1].type == f"response.{status}"
    assert events[-1].response.status == status
    if status == "failed":
        assert plain.error.code == "server_error" and f"finish reason {reason}" in plain.error.message
    else:
        assert plain.error is None
    wait_whole(served)


@pytest.mark.parametrize("reason", [FinishReason.ERROR, FinishReason.ABORT])
def test_an_engine_ending_is_an_anthropic_error(anthropic_client, served, ending, reason):
    messages = [{"role": "user", "content": "Say hello"}]
    ending(reason)
    with pytest.raises(anthropic.APIStatusError, match=f"finish reason {reason}") as plain:
        anthropic_client.messages.create(model="tiny", max_tokens=40, messages=messages)
    assert plain.value.status_code == (500 if reason == FinishReason.ERROR else 503)
    with pytest.raises(anthropic.APIStatusError, match=f"finish reason {reason}"):
        with anthropic_client.messages.stream(model="tiny", max_tokens=40, messages=messages) as stream:
            "".join(stream.text_stream)
    wait_whole(served)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/responses", {"input": "Hi"}),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}),
    ],
)
def test_n_is_a_400_naming_it(served, path, body):
    request = urllib.request.Request(
        served.http_url + path,
        json.dumps({"model": "tiny", "n": 2, **body}).encode(),
        {"Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=30)
    error = json.load(caught.value)["error"]
    assert caught.value.code == 400 and error["param"] == "n" and "one answer" in error["message"]
