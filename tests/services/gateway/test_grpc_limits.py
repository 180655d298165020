"""gRPC field caps, logit_bias over gRPC, finite masked logprobs, and the client's
status-code mapping (a message-size RESOURCE_EXHAUSTED is not a `QueueFull`)."""

import math

import grpc
import pytest

from services.client import MessageTooLarge, QueueFull, ResourceExhausted, ShinkaiClient
from services.client.errors import from_rpc_error
from services.client.messages import generate_request
from services.gateway.frontend import MASKED_LOGPROB
from services.gateway.grpc_api import MAX_ID_BYTES
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from tests.services.gateway.support import generate, refusal

pytestmark = pytest.mark.timeout(60)


def test_a_long_client_request_id_is_refused_before_anything_streams(served):
    err = refusal(served.grpc_target, generate_request("Hi", max_tokens=64, client_request_id="x" * (3 << 20)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("client_request_id is 3145728 bytes, over the limit of 256")
    at_cap = generate_request("Hi", max_tokens=1, client_request_id="x" * MAX_ID_BYTES)
    assert len(generate(served.grpc_target, at_cap)) >= 1


def big_chat() -> pb.GenerateRequest:
    request = generate_request(messages=[{"role": "user", "content": "x"}], max_tokens=1)
    for _ in range(5000):
        request.chat.messages.add(role="user", content="x")
    return request


@pytest.mark.parametrize(
    "build,field",
    [
        (lambda: generate_request("Hi", model="m" * 300, max_tokens=1), "model"),
        (lambda: generate_request([0] * 5000, max_tokens=1), "token_ids"),
        (big_chat, "chat.messages"),
        (
            lambda: generate_request(messages=[{"role": "r" * 100, "content": "x"}], max_tokens=1),
            "chat.messages[0].role",
        ),
        (lambda: generate_request("Hi", max_tokens=1, stop_token_ids=[1] * 2000), "sampling.stop_token_ids"),
    ],
)
def test_every_field_has_a_cap_named_in_the_refusal(served, build, field):
    err = refusal(served.grpc_target, build())
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith(f"{field} is "), err.details()


@pytest.mark.parametrize("prompt", ["Hi", [0, 5], [{"role": "user", "content": "Hi"}]])
def test_max_tokens_over_the_context_is_refused_by_name(served, prompt):
    """A max_tokens past the context names max_tokens (not a prompt over a negative budget), for every prompt."""
    chat = isinstance(prompt[0], dict)
    request = generate_request(None if chat else prompt, messages=prompt if chat else None, max_tokens=1 << 62)
    err = refusal(served.grpc_target, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == f"max_tokens must be between 1 and the context of 4096 tokens, got {1 << 62}"


def test_abort_client_request_id_is_capped(served):
    with grpc.insecure_channel(served.grpc_target) as ch:
        abort = ch.unary_unary("/shinkai.v1.Shinkai/Abort", request_serializer=pb.AbortRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as info:
            abort(pb.AbortRequest(client_request_id="y" * 1000), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "client_request_id" in info.value.details()


def test_logit_bias_over_grpc(served):
    request = generate_request([0, 5, 6], max_tokens=1, temperature=0)
    first = [r for r in generate(served.grpc_target, request) if r.HasField("chunk")][0].chunk.token_ids[0]
    request.sampling.logit_bias[first] = -100
    banned = [r for r in generate(served.grpc_target, request) if r.HasField("chunk")][0].chunk.token_ids[0]
    assert banned != first
    request.sampling.logit_bias[first] = 0
    request.sampling.logit_bias[banned] = 100  # added to its logit: greedy takes it however it ranked
    assert [r for r in generate(served.grpc_target, request) if r.HasField("chunk")][0].chunk.token_ids[0] == banned
    request.sampling.logit_bias[first] = 100.5
    err = refusal(served.grpc_target, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.logit_bias" in err.details()


def test_masked_logprobs_are_finite_over_grpc(served):
    responses = generate(served.grpc_target, generate_request("Hi", max_tokens=2, logprobs=2, top_k=1))
    tops = [e.logprob for r in responses if r.HasField("chunk") for t in r.chunk.top_logprobs for e in t.entries]
    assert MASKED_LOGPROB in tops and all(math.isfinite(v) for v in tops)


class _Err(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_client_maps_resource_exhausted_by_cause():
    full = from_rpc_error(_Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), (("retry-after", "2"),))
    assert type(full) is QueueFull and full.retry_after_s == 2
    size = from_rpc_error(_Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "Received message larger than max (5 vs. 4)"))
    assert type(size) is MessageTooLarge
    other = from_rpc_error(_Err(grpc.StatusCode.RESOURCE_EXHAUSTED, "something else"))
    assert type(other) is ResourceExhausted and not isinstance(other, QueueFull)


def test_a_request_over_the_message_size_is_message_too_large(served):
    with ShinkaiClient(served.grpc_target, timeout=30) as client:
        with pytest.raises(MessageTooLarge):
            client.generate("x" * (5 << 20), max_tokens=1)
