"""--api-key: HTTP 401 and gRPC UNAUTHENTICATED without a valid key, health and metrics open, and Abort
scoped to the caller's key (services/gateway/auth.py)."""

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client import ShinkaiClient, Unauthenticated
from tests.services.gateway.support import own_server
from tests.services.gateway.test_bad_input import OK

pytestmark = pytest.mark.timeout(120)
KEYS = ("key-alice", "key-bob")


@pytest.fixture(scope="module")
def keyed():
    with own_server(engine_args={"max_num_seqs": 4}, api_keys=KEYS) as thread:
        yield thread


def call(url: str, path: str, body=None, key: str | None = None, scheme: str = "Bearer"):
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"{scheme} {key}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


@pytest.mark.parametrize("key,scheme", [(None, "Bearer"), ("wrong", "Bearer"), ("key-alice", "Basic"), ("", "Bearer")])
def test_http_without_a_valid_key_is_401(keyed, key, scheme):
    for path, body in (("/v1/completions", OK), ("/v1/models", None)):
        status, data, headers = call(keyed.http_url, path, body, key, scheme)
        error = json.loads(data)["error"]
        assert status == 401 and error["code"] == "invalid_api_key" and headers["www-authenticate"] == "Bearer"
        assert "key-alice" not in data.decode() and "key-bob" not in data.decode()


def test_http_with_either_key_is_served(keyed):
    for key in KEYS:
        status, data, _ = call(keyed.http_url, "/v1/completions", OK, key)
        assert status == 200, data


def test_health_and_metrics_stay_open(keyed):
    for path in ("/health", "/metrics"):
        assert call(keyed.http_url, path)[0] == 200
    with grpc.insecure_channel(keyed.grpc_target) as ch:
        reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_without_a_valid_key_is_unauthenticated(keyed):
    for key in (None, "wrong"):
        with ShinkaiClient(keyed.grpc_target, timeout=30, api_key=key) as c:
            for attempt in (lambda: c.generate("Hi", max_tokens=1), c.model_info, c.loads, lambda: c.abort("x")):
                with pytest.raises(Unauthenticated) as info:
                    attempt()
                assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with ShinkaiClient(keyed.grpc_target, timeout=30, api_key="key-bob") as c:
        assert c.generate("Hi", max_tokens=1).finish_reason == "length"


def test_abort_reaches_only_the_callers_own_requests(keyed):
    """Alice and Bob both run a request called "shared"; Bob's Abort ends only his."""
    with (
        ShinkaiClient(keyed.grpc_target, timeout=60, api_key="key-alice") as alice,
        ShinkaiClient(keyed.grpc_target, timeout=60, api_key="key-bob") as bob,
    ):
        started = {"alice": threading.Event(), "bob": threading.Event()}
        finals = {}

        def run(name, client):
            for delta in client.generate_stream("Hi", client_request_id="shared", max_tokens=3000, ignore_eos=True):
                started[name].set()
                if delta.finish_reason is not None:
                    finals[name] = delta.finish_reason

        threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("alice", alice), ("bob", bob))]
        for t in threads:
            t.start()
        assert all(e.wait(30) for e in started.values())
        assert bob.abort("shared") is True
        threads[1].join(30)
        assert finals == {"bob": "abort"}  # Alice's is still running
        assert alice.abort("shared") is True
        threads[0].join(30)
        assert finals == {"bob": "abort", "alice": "abort"}


NEW_ENDPOINTS = [
    ("/v1/responses", {"model": "tiny", "input": "Hi", "max_output_tokens": 2}),
    ("/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}),
    ("/tokenize", {"model": "tiny", "prompt": "Hi"}),
    ("/detokenize", {"model": "tiny", "tokens": [19923]}),
]


@pytest.mark.parametrize("path,body", NEW_ENDPOINTS, ids=[p for p, _ in NEW_ENDPOINTS])
def test_the_other_endpoints_check_the_key_too(keyed, path, body):
    assert call(keyed.http_url, path, body)[0] == 401
    assert call(keyed.http_url, path, body, "wrong")[0] == 401
    status, data, _ = call(keyed.http_url, path, body, "key-bob")
    assert status == 200, data
    if path == "/v1/messages":  # Anthropic clients send theirs as x-api-key
        req = urllib.request.Request(
            keyed.http_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "x-api-key": "key-alice"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            assert r.status == 200
