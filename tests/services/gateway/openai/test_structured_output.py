"""Structured output over HTTP with the `openai` client: ``response_format`` (json_schema with strict, json_object)
on chat, vLLM's guided_* and structured_outputs on completions and chat; outputs validate; bad constraints are 400s
naming the field."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
    },
    "required": ["city", "unit", "temp"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "The weather in Paris, as JSON."}]


@pytest.fixture(scope="module")
def openai_client(served):
    """The package's `openai_client` with a 120 s timeout instead of 60 s."""
    return openai.OpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_json_schema_validates(openai_client):
    reply = openai_client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=96,
        seed=1,
        n=2,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}},
    )
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_json_schema_streams_valid_json(openai_client):
    stream = openai_client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=96,
        seed=2,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}},
    )
    text, reasons = "", []
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            reasons.append(choice.finish_reason)
    assert "stop" in reasons
    jsonschema.validate(json.loads(text), SCHEMA)


def test_chat_json_object_gives_an_object(openai_client):
    reply = openai_client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, seed=3, response_format={"type": "json_object"}
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":  # free JSON may run past max_tokens; what came out is still a JSON prefix
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.lstrip().startswith("{")


@pytest.mark.parametrize(
    "extra,check",
    [
        ({"guided_regex": r"\d{3}-[a-z]{2,4}"}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
        ({"guided_choice": ["left", "right", "up"]}, lambda t: t in ("left", "right", "up")),
        (
            {"guided_grammar": 'root ::= "(" [0-9] ("+" [0-9]){0,2} ")"'},
            lambda t: re.fullmatch(r"\([0-9](\+[0-9]){0,2}\)", t),
        ),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"regex": r"\d{3}-[a-z]{2,4}"}}, lambda t: re.fullmatch(r"\d{3}-[a-z]{2,4}", t)),
        ({"structured_outputs": {"choice": ["left", "right", "up"]}}, lambda t: t in ("left", "right", "up")),
        (
            {"structured_outputs": {"json": SCHEMA, "disable_fallback": True}},
            lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None,
        ),
    ],
    ids=["regex", "choice", "grammar", "json", "so-regex", "so-choice", "so-json"],
)
def test_completions_guided_fields(openai_client, extra, check):
    reply = openai_client.completions.create(model="tiny", prompt="Say:", max_tokens=96, seed=4, extra_body=extra)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and check(choice.text), choice


def test_structured_outputs_json_object_gives_an_object(openai_client):
    reply = openai_client.completions.create(
        model="tiny", prompt="Say:", max_tokens=8, seed=4, extra_body={"structured_outputs": {"json_object": True}}
    )
    assert reply.choices[0].text.startswith("{"), reply  # free JSON runs past 8 tokens; it is an object's start


def test_chat_structured_outputs_runs_without_thinking(openai_client):
    """vLLM's structured_outputs on chat: the answer is the constrained content, with no reasoning before it."""
    reply = openai_client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=96,
        seed=5,
        extra_body={"structured_outputs": {"choice": ["rain", "sun"]}},
    )
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "stop" and message.content in ("rain", "sun"), reply
    assert not getattr(message, "reasoning_content", None)


def test_structured_outputs_disable_additional_properties_makes_the_schema_strict():
    from services.gateway.openai.constraints import constraint_of

    loose = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert not constraint_of({"structured_outputs": {"json": loose}}).strict  # vLLM's default: extra keys allowed
    strict = constraint_of({"structured_outputs": {"json": loose, "disable_additional_properties": True}})
    assert strict.kind == "json_schema" and strict.strict
    assert constraint_of({"structured_outputs": {"json_object": False, "disable_fallback": False}}) is None


@pytest.mark.parametrize(
    "extra,param,named",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
            "nvalid json schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format",
            "'not'",
        ),
        (
            {"response_format": {"type": "json_object"}, "thinking": {"type": "enabled"}},
            "response_format",
            "without thinking",
        ),
        ({"guided_regex": "(ab"}, "guided_regex", "regex"),
        ({"guided_grammar": "root ::= b"}, "guided_grammar", "grammar"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "one structured-output field"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs.choice", "one structured-output"),
        ({"structured_outputs": {"choice": ["a"]}, "guided_regex": "a"}, "structured_outputs.choice", "one structured"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "structural tags"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern", "whitespace"),
        (
            {"structured_outputs": {"disable_any_whitespace": True}},
            "structured_outputs.disable_any_whitespace",
            "white",
        ),
        ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object", "boolean"),
        ({"structured_outputs": {"jsonn": {}}}, "structured_outputs.jsonn", "not a structured_outputs field"),
        ({"structured_outputs": ["json"]}, "structured_outputs", "an object"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field(openai_client, extra, param, named):
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, extra_body=extra)
    body = err.value.body
    assert body["param"] == param and named.lower() in body["message"].lower(), body


def test_a_compile_over_the_limit_is_a_400_and_leaves_nothing_queued(openai_client, served, monkeypatch):
    """A compile still running at the limit (one that never finishes: the limit's check, not the machine's speed)."""
    engine = served.server.engine.engine
    monkeypatch.setattr(engine.structured.gate, "timeout_s", 0.05)
    monkeypatch.setattr(engine.structured.grammars, "compile", lambda constraint: Future())
    props = {f"slow{i}": {"type": "string", "pattern": f"^[a-z]{{{i},{i + 40}}}$"} for i in range(12)}
    with pytest.raises(openai.BadRequestError) as err:
        openai_client.completions.create(
            model="tiny",
            prompt="Say:",
            max_tokens=4,
            extra_body={"guided_json": {"type": "object", "properties": props}},
        )
    assert "to compile" in err.value.body["message"]
    monkeypatch.undo()
    reply = openai_client.completions.create(model="tiny", prompt="Say:", max_tokens=2)  # the server still serves
    assert reply.choices[0].finish_reason == "length"
