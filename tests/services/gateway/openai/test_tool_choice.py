"""tool_choice "required" and a named function through the `openai` client: the random tiny model's output is held
to the DSML tool-call grammar, so every answer is tool calls whose arguments validate against their tool's schema,
with and without thinking, plain and streamed; without the constraint the same model writes no call."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

THINK_END_ID = 128822


def _tool(name: str, properties: dict, required: list[str] | None = None) -> dict:
    parameters = {"type": "object", "properties": properties, "required": required or list(properties)}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": parameters}}


WEATHER = _tool(
    "get_weather",
    {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    ["city"],
)
ADD = _tool("add", {"a": {"type": "integer", "minimum": -100, "maximum": 100}, "b": {"type": "boolean"}})
TAGS = _tool(
    "set_tags",
    {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
        "pinned": {"type": "boolean"},
        "owner": {
            "type": "object",
            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999}, "kind": {"enum": ["user", "bot"]}},
            "required": ["id", "kind"],
            "additionalProperties": False,
        },
    },
)
CLOCK = {"type": "function", "function": {"name": "clock"}}  # no parameters: a call with none
TOOLS = [WEATHER, ADD, TAGS, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}}) for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Use the tools."}]


@pytest.fixture(scope="module")
def openai_client(served):
    """conftest.py's client with a longer timeout: a tool-call grammar's first compile builds the vocabulary tables."""
    return openai.OpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0, timeout=240)


def _check_calls(calls, names: set[str]) -> None:
    assert calls, "no tool calls"
    for call in calls:
        assert call.type == "function" and call.id
        assert call.function.name in names, call.function.name
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_gives_valid_calls(openai_client):
    reply = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=1500, seed=7, n=2
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert not choice.message.content
        _check_calls(choice.message.tool_calls, set(SCHEMAS))


@pytest.mark.parametrize("name", ["set_tags", "clock"])  # every kind of parameter; none
def test_a_named_function_is_called_once(openai_client, name):
    reply = openai_client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": name}},
        max_tokens=1500,
        seed=11,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    _check_calls([call], {name})


def test_calls_stream_as_they_come_plain(openai_client):
    """The streamed answer (accumulated by the openai_client) has the plain answer's calls; both run at once."""
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=1500, seed=3)

    def streamed():
        with openai_client.chat.completions.stream(**kwargs) as stream:
            return stream.get_final_completion()

    with ThreadPoolExecutor(2) as pool:
        plain, whole = pool.submit(openai_client.chat.completions.create, **kwargs), pool.submit(streamed)
        plain, whole = plain.result(), whole.result()
    assert whole.choices[0].finish_reason == "tool_calls"
    got = [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert got == [(c.function.name, c.function.arguments) for c in plain.choices[0].message.tool_calls]
    _check_calls(whole.choices[0].message.tool_calls, {"get_weather"})


def test_one_call_without_parallel_tool_calls(openai_client):
    reply = openai_client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, ADD],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=1500,
        seed=5,
        n=2,
    )
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, {"get_weather", "add"})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "add"}}])
def test_thinking_then_calls(openai_client, choice):
    """Thinking switched on: reasoning runs free to </think> (biased up so the random model gets there), then the
    calls are forced."""
    reply = openai_client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=[WEATHER, ADD, CLOCK],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=1500,
        seed=13,
        n=2,
        logit_bias={str(THINK_END_ID): 9},
        extra_body={"thinking": {"type": "enabled"}},
    )
    names = {"get_weather", "add", "clock"} if choice == "required" else {"add"}
    for c in reply.choices:
        assert c.finish_reason == "tool_calls", c
        assert "DSML" not in (getattr(c.message, "reasoning_content", None) or "")
        _check_calls(c.message.tool_calls, names)


def test_without_the_constraint_no_call_is_made(openai_client):
    reply = openai_client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=30,
        seed=7,
        n=2,
        extra_body={"thinking": {"type": "disabled"}},
    )
    assert all(not c.message.tool_calls and c.finish_reason != "tool_calls" for c in reply.choices)


@pytest.mark.parametrize(
    "extra,param,match",
    [
        ({"tools": [_tool("f", {"x": {"type": "string", "not": {"const": "a"}}})]}, "tools", "'not'"),
        ({"tools": [_tool("f", {"x": {"type": "strin"}})]}, "tools", "tools\\[0\\] \\(f\\) parameters"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
            "tools",
            "type object",
        ),
        ({"response_format": {"type": "json_object"}}, "response_format", "cannot be combined with tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ],
)
def test_bad_tool_choice_requests_are_400s(openai_client, extra, param, match):
    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 8}
    body.update(extra)
    with pytest.raises(openai.BadRequestError, match=match) as err:
        openai_client.chat.completions.create(**body)
    assert err.value.body["param"] == param
