"""Reasoning, tool calls and stop strings through shinkai.v1 and the Python client, the model's output forced."""

import json

import grpc
import pytest

from services.client import InvalidArgument
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from tests.services.gateway.openai.test_chat_reasoning import USER, WEATHER, dsml
from tests.services.gateway.support import refusal

pytestmark = pytest.mark.timeout(120)


def test_reasoning_and_content_stream_apart(grpc_client, forced):
    with forced.forcing("Let me think.</think>The answer is 4."):
        deltas = list(grpc_client.generate_stream(messages=USER, max_tokens=40))
        whole = grpc_client.generate(messages=USER, max_tokens=40)
    assert "".join(d.reasoning_content for d in deltas) == whole.reasoning_content == "Let me think."
    assert "".join(d.content for d in deltas) == whole.content == "The answer is 4."
    assert not any("</think>" in d.reasoning_content + d.content for d in deltas)
    assert whole.finish_reason == deltas[-1].finish_reason == "stop"


def test_tool_loop(grpc_client, forced, served):
    with forced.forcing("Look it up.</think>" + dsml(("get_weather", {"city": "Paris", "days": 2}))):
        whole = grpc_client.generate(messages=USER, tools=[WEATHER], max_tokens=100)
        deltas = list(grpc_client.generate_stream(messages=USER, tools=[WEATHER], max_tokens=100))
    assert whole.finish_reason == "tool_calls" and deltas[-1].finish_reason == "tool_calls"
    (call,) = whole.tool_calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    pieces = [p for d in deltas for p in d.tool_calls]
    assert len(pieces) > 1 and "".join(p.arguments for p in pieces) == call.arguments
    history = [
        *USER,
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": whole.reasoning_content,
            "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "rain"},
    ]
    with forced.forcing("Rain.</think>It rains in Paris."):
        answer = grpc_client.generate(messages=history, tools=[WEATHER], max_tokens=60)
    assert answer.content == "It rains in Paris." and answer.finish_reason == "stop"
    rendered = served.server.chat.render({"messages": history, "tools": [WEATHER]})
    assert "<tool_result>rain</tool_result>" in rendered.prompt and answer.prompt_tokens == len(rendered.token_ids)


def test_stop_strings(grpc_client, forced):
    with forced.forcing("one two three four", end=False):
        whole = grpc_client.generate("x", max_tokens=30, ignore_eos=True, stop=["three"])
        kept = grpc_client.generate(
            "x", max_tokens=30, ignore_eos=True, stop=["three"], include_stop_str_in_output=True
        )
    assert whole.text == "one two " and whole.finish_reason == "stop"
    assert kept.text == "one two three" and kept.completion_tokens == whole.completion_tokens


def test_bad_chat_options_name_the_field(grpc_client):
    with pytest.raises(InvalidArgument, match="reasoning_effort"):
        grpc_client.generate(messages=USER, max_tokens=1, reasoning_effort="ultra")
    with pytest.raises(InvalidArgument, match="at most 4"):
        grpc_client.generate("x", max_tokens=1, stop=["a", "b", "c", "d", "e"])


@pytest.mark.parametrize(
    "parameters_json,message",
    [
        ("[" * 5000 + "]" * 5000, "chat.tools[0].parameters_json is nested deeper than 64 levels"),
        ('{"a":' * 70 + "1" + "}" * 70, "chat.tools[0].parameters_json: the body is nested deeper than 64 levels"),
        ('{"type": "object", "default": NaN}', "chat.tools[0].parameters_json: default must be a finite number"),
        ("{bad", "chat.tools[0].parameters_json is not JSON"),
    ],
)
def test_a_tool_schema_past_the_json_limits_names_its_field(served, parameters_json, message):
    """A tool's parameters_json is held to the HTTP body's JSON limits: INVALID_ARGUMENT naming it, never
    INTERNAL (a schema nested past the parser's recursion limit was one)."""
    chat = pb.ChatMessages(
        messages=[pb.ChatMessage(role="user", content="x")], tools=[pb.Tool(name="f", parameters_json=parameters_json)]
    )
    err = refusal(served.grpc_target, pb.GenerateRequest(chat=chat, sampling=pb.SamplingParams(max_tokens=1)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(message), err.details()
