"""Structured output through shinkai.v1: ``sampling.constraint`` is enforced, a bad one is INVALID_ARGUMENT naming
it, the gateway's remote engine carries a request's constraint unchanged, and a chat's tool_choice "required" or
function name gives valid tool calls."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest

from services.client import ShinkaiClient
from services.client.messages import generate_request
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint
from services.gateway import grpc_api
from services.gateway.remote import _sampling
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from tests.services.gateway.openai.test_tool_choice import ADD, MESSAGES, SCHEMAS, WEATHER
from tests.services.gateway.support import generate, refusal

pytestmark = pytest.mark.timeout(120)

REGEX = r"[a-c]{2,5}-\d{1,3}"


def _request(kind: str, spec: str) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=32, seed=5, constraint=pb.OutputConstraint(kind=kind, spec=spec))
    return pb.GenerateRequest(text="Say:", sampling=sampling)


def test_a_constraint_over_grpc_is_enforced(served):
    responses = generate(served.grpc_target, _request("regex", REGEX))
    text = "".join(r.chunk.text for r in responses if r.WhichOneof("kind") == "chunk")
    final = responses[-1].final
    text += final.text
    assert final.finish_reason == pb.FINISH_REASON_STOP and re.fullmatch(REGEX, text), text


@pytest.mark.parametrize(
    "kind,spec,named",
    [
        ("regex", "[a-", "regex"),
        ("xml", "", "constraint kind"),
        ("json_object", '{"type": "object"}', "json_object takes no spec"),
        ("json_schema", "{not json", "json_schema: not JSON"),
        ("json_schema", '{"type": 5}', "json_schema: invalid schema"),
        ("choice", "[]", "choice"),
        ("grammar", "root ::= (", "grammar"),
    ],
)
def test_a_bad_constraint_is_invalid_argument(served, kind, spec, named):
    err = refusal(served.grpc_target, _request(kind, spec))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("sampling.constraint:") and named in err.details()


def test_the_remote_engine_carries_the_constraint():
    constraint = Constraint("json_schema", '{"type": "object"}', strict=False)
    sampling = _sampling(SamplingParams(max_tokens=4, constraint=constraint))
    assert grpc_api._constraint(sampling, None) == constraint
    assert grpc_api._constraint(_sampling(SamplingParams(max_tokens=4)), None) is None


@pytest.mark.parametrize("choice,names", [("required", {"get_weather", "add"}), ("add", {"add"})])
def test_chat_tool_choice_over_grpc_gives_valid_calls(served, choice, names):
    """tool_choice "required" or a function's name: the chat's answer is tool calls whose arguments validate,
    whole and streamed (the stream's pieces add up to the same calls)."""
    tools = [WEATHER, ADD]
    with ShinkaiClient(served.grpc_target, timeout=240) as client, ThreadPoolExecutor(2) as pool:
        kwargs = dict(messages=MESSAGES, tools=tools, tool_choice=choice, max_tokens=1500, seed=21)
        whole = pool.submit(client.generate, **kwargs)
        deltas = pool.submit(lambda: list(client.generate_stream(**kwargs)))
        whole, deltas = whole.result(), deltas.result()
    assert whole.finish_reason == deltas[-1].finish_reason == "tool_calls"
    assert whole.tool_calls and (choice == "required" or len(whole.tool_calls) == 1)
    for call in whole.tool_calls:
        assert call.name in names
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    pieces = [p for d in deltas for p in d.tool_calls]
    assert "".join(p.arguments for p in pieces) == "".join(c.arguments for c in whole.tool_calls)


def test_chat_tool_choice_and_a_constraint_is_invalid_argument(served):
    request = generate_request(messages=MESSAGES, tools=[WEATHER], tool_choice="required", max_tokens=8)
    request.sampling.constraint.CopyFrom(pb.OutputConstraint(kind="regex", spec="a+"))
    err = refusal(served.grpc_target, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot be combined" in err.details()
