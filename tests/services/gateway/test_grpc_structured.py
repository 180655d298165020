"""Structured output through shinkai.v1: ``sampling.constraint`` is enforced, a bad one is INVALID_ARGUMENT naming
it, and the gateway's remote engine carries a request's constraint unchanged."""

from __future__ import annotations

import re

import grpc
import pytest

from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint
from services.gateway import grpc_api
from services.gateway.remote import _sampling
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from tests.services.gateway.test_grpc_limits import generate, refusal

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


@pytest.mark.parametrize("kind,spec,named", [("regex", "[a-", "regex"), ("xml", "", "constraint kind")])
def test_a_bad_constraint_is_invalid_argument(served, kind, spec, named):
    err = refusal(served.grpc_target, _request(kind, spec))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("sampling.constraint:") and named in err.details()


def test_the_remote_engine_carries_the_constraint():
    constraint = Constraint("json_schema", '{"type": "object"}', strict=False)
    sampling = _sampling(SamplingParams(max_tokens=4, constraint=constraint))
    assert grpc_api._constraint(sampling, None) == constraint
    assert grpc_api._constraint(_sampling(SamplingParams(max_tokens=4)), None) is None
