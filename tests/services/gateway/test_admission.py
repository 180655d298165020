"""Admission per tenant (services/gateway/admission.py): a tenant over its live-request or queued-token limit
gets 429 with retry-after (gRPC RESOURCE_EXHAUSTED) while other tenants are served; accounts go with their last
request; the tenant is the API key's owner, else the client's address, and a client cannot name its own."""

import argparse
import json
import time
import urllib.error
import urllib.request

import grpc
import pytest

from services.client import InvalidArgument, QueueFull, ShinkaiClient
from services.gateway.admission import (
    Admission,
    AdmissionLimits,
    TenantOverLimit,
    add_admission_arguments,
    admission_limits,
)
from services.gateway.auth import owner
from services.gateway.frontend import GenerateArgs, tenant_of
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from tests.services.gateway.support import gateway_argv, own_server, post

pytestmark = pytest.mark.timeout(120)
KEYS = ("key-alice", "key-bob")


def test_a_tenant_at_its_request_limit_is_refused_and_others_are_not():
    admission = Admission(AdmissionLimits(max_requests=2, max_queued_tokens=100))
    first = admission.admit("a", 10)
    admission.admit("a", 10)
    with pytest.raises(TenantOverLimit, match="2 live requests; the limit is 2") as info:
        admission.admit("a", 1)
    assert info.value.retry_after_s >= 1
    admission.admit("b", 10)  # another tenant is not held back
    first.done()
    admission.admit("a", 10)  # a place came back


def test_queued_tokens_count_until_the_first_token_and_a_lone_prompt_always_passes():
    admission = Admission(AdmissionLimits(max_requests=10, max_queued_tokens=100))
    long = admission.admit("a", 500)  # nothing queued: passes, however long
    with pytest.raises(TenantOverLimit, match="500 prompt tokens queued"):
        admission.admit("a", 1)
    long.started()
    short = admission.admit("a", 60)
    with pytest.raises(TenantOverLimit, match="60 prompt tokens queued; 41 more"):
        admission.admit("a", 41)
    admission.admit("a", 40)
    short.started()
    short.started()  # idempotent
    assert admission.accounts["a"].num_queued_tokens == 40


def test_accounts_go_with_the_last_choice_of_the_last_request():
    admission = Admission(AdmissionLimits(max_requests=10, max_queued_tokens=100))
    three = admission.admit("a", 5, num_choices=3)
    one = admission.admit("a", 5)
    three.done()
    three.done()
    one.cancel()
    assert admission.accounts["a"].num_requests == 1 and admission.accounts["a"].num_queued_tokens == 5
    three.done()
    three.done()  # past its choices: no effect
    assert admission.accounts == {}


def test_limits_are_positive_and_the_defaults_need_no_flags(capsys):
    with pytest.raises(ValueError, match="max_requests limit must be a positive integer"):
        AdmissionLimits(max_requests=0)
    parser = argparse.ArgumentParser()
    add_admission_arguments(parser)
    assert admission_limits(parser.parse_args([])) == AdmissionLimits()
    for bad in ("0", "-3", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-requests-per-tenant", bad])
        assert "--max-requests-per-tenant" in capsys.readouterr().err


def test_up_gives_the_gateway_process_its_limits_and_the_defaults_add_no_flags():
    from services.entrypoints.stack_config import StackConfig

    limits = AdmissionLimits(max_requests=3, max_queued_tokens=5000)
    parser = argparse.ArgumentParser()
    add_admission_arguments(parser)
    known, _ = parser.parse_known_args(gateway_argv(StackConfig(model="tiny", admission=limits)))
    assert admission_limits(known) == limits
    assert not any("per-tenant" in arg for arg in gateway_argv(StackConfig(model="tiny")))


def test_the_tenant_is_the_forwarded_one_else_the_key_else_the_address():
    assert tenant_of(GenerateArgs(None, owner="k1", client_address="10.0.0.5")) == "k1"
    assert tenant_of(GenerateArgs(None, client_address="10.0.0.5")) == "10.0.0.5"
    assert tenant_of(GenerateArgs(None, tenant="k1", client_address="10.0.0.9")) == "k1"
    assert tenant_of(GenerateArgs(None)) == ""


# ---- through the server ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited():
    with own_server(
        engine_args={"max_num_seqs": 4},
        api_keys=KEYS,
        admission=AdmissionLimits(max_requests=1, max_queued_tokens=100_000),
    ) as thread:
        yield thread
    assert thread.server.frontend.admission.accounts == {}


def complete(url: str, body: dict, key: str):
    """POST /v1/completions with ``key`` as the bearer token."""
    return post(url, "/v1/completions", body, {"Authorization": f"Bearer {key}"}, timeout=60)


def test_a_key_over_its_limit_gets_429_while_another_key_is_served(limited):
    long = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    with ShinkaiClient(limited.grpc_target, timeout=60, api_key="key-alice") as alice:
        # Alice's one request stays live: 4,000 tokens outlast the checks below (the gateway reads the engine's
        # deltas whether or not this client reads them, so only the length holds it).
        stream = alice.generate_stream([1, 2, 3], max_tokens=4000, ignore_eos=True)
        next(stream)
        rejected = limited.server.metrics.rejected.labels(reason="tenant_limit")
        num_rejected = rejected._value.get()
        code, reply, headers = complete(limited.http_url, long | {"max_tokens": 1}, "key-alice")
        assert code == 429, reply
        assert reply["error"]["type"] == "rate_limit_error" and reply["error"]["code"] == "rate_limit_exceeded"
        assert "the limit is 1" in reply["error"]["message"]
        assert int(headers["retry-after"]) >= 1
        with pytest.raises(QueueFull) as info:
            alice.generate([1, 2], max_tokens=1)
        assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and info.value.retry_after_s >= 1
        assert rejected._value.get() == num_rejected + 2  # counted as rejections (reason tenant_limit)
        code, reply, _ = complete(limited.http_url, long | {"max_tokens": 2}, "key-bob")
        assert code == 200, reply
        stream.close()
    # Alice's stream was cancelled: once the server has seen it end (asynchronously), her place is back.
    alice_tenant = owner(b"key-alice")
    deadline = time.monotonic() + 30
    while alice_tenant in limited.server.frontend.admission.accounts and time.monotonic() < deadline:
        time.sleep(0.05)
    code, reply, _ = complete(limited.http_url, long | {"max_tokens": 2}, "key-alice")
    assert code == 200, reply


def test_a_client_cannot_name_its_own_tenant(limited):
    with ShinkaiClient(limited.grpc_target, timeout=30, api_key="key-bob") as bob:
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2]), tenant="key-alice's")
        with pytest.raises(InvalidArgument, match="tenant is set by the server"):
            list(bob._stream(request, 30))
        request.tenant = "t" * 257
        with pytest.raises(InvalidArgument, match="tenant is 257 bytes, over the limit of 256"):
            list(bob._stream(request, 30))


def test_an_open_api_names_the_tenant_by_the_client_address_over_http_and_grpc(served):
    """No keys: the tenant is the caller's host, the same for HTTP and for gRPC (whatever the port)."""
    engine = served.server.engine
    tenants = []
    submit = engine.submit

    def recording(*args, **kwargs):
        tenants.append(kwargs.get("tenant"))
        return submit(*args, **kwargs)

    engine.submit = recording
    try:
        body = json.dumps({"model": "tiny", "prompt": [1, 2], "max_tokens": 1}).encode()
        req = urllib.request.Request(
            served.http_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.status == 200
        with ShinkaiClient(served.grpc_target, timeout=60) as client:
            client.generate([1, 2], max_tokens=1)
    finally:
        del engine.submit
    assert tenants == ["127.0.0.1", "127.0.0.1"]
