"""OpenAI Responses and Anthropic Messages with their structured-output fields, through their own clients: the
recipe's output constraint is enforced (``text.format``, a required or named tool), never dropped."""

from __future__ import annotations

import json

import anthropic
import jsonschema
import openai
import pytest

from tests.services.gateway.openai.test_tool_choice import ADD, SCHEMAS, WEATHER

pytestmark = pytest.mark.timeout(300)

FORMAT_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "ok": {"type": "boolean"}},
    "required": ["city", "ok"],
    "additionalProperties": False,
}


def _responses_tool(tool: dict) -> dict:
    return {"type": "function", **tool["function"]}


@pytest.fixture(scope="module")
def openai_client(served):
    """conftest.py's client with a longer timeout: a tool-call grammar's first compile builds the vocabulary tables."""
    return openai.OpenAI(base_url=served.http_url + "/v1", api_key="unused", max_retries=0, timeout=240)


def test_responses_required_tool_call_validates(openai_client):
    reply = openai_client.responses.create(
        model="tiny",
        input="Use a tool.",
        tools=[_responses_tool(WEATHER), _responses_tool(ADD)],
        tool_choice="required",
        reasoning={"effort": "none"},
        max_output_tokens=1500,
    )
    calls = [item for item in reply.output if item.type == "function_call"]
    assert calls and reply.status == "completed"
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_responses_json_schema_format_validates(openai_client):
    reply = openai_client.responses.create(
        model="tiny",
        input="The weather, as JSON.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": FORMAT_SCHEMA}},
        reasoning={"effort": "none"},
        max_output_tokens=200,
    )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), FORMAT_SCHEMA)


def test_anthropic_named_tool_validates(served):
    openai_client = anthropic.Anthropic(base_url=served.http_url, api_key="unused", max_retries=0, timeout=240)
    add = ADD["function"]
    reply = openai_client.messages.create(
        model="tiny",
        max_tokens=1500,
        messages=[{"role": "user", "content": "Add."}],
        tools=[{"name": add["name"], "description": add["description"], "input_schema": add["parameters"]}],
        tool_choice={"type": "tool", "name": "add"},
        thinking={"type": "disabled"},
    )
    uses = [block for block in reply.content if block.type == "tool_use"]
    assert uses and reply.stop_reason == "tool_use"
    for use in uses:
        assert use.name == "add"
        jsonschema.validate(use.input, SCHEMAS["add"])
