"""Health and readiness of the in-process server: /ready runs a real one-token generation; a dependency
problem turns /health and /ready 503 naming it, grpc.health.v1 NOT_SERVING, and new requests 503 /
UNAVAILABLE with the cause; clearing it serves again. The probe says why when a generation fails."""

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client import ShinkaiClient, Unavailable
from services.gateway.probe import probe

pytestmark = pytest.mark.timeout(120)


def get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def grpc_status(target: str) -> int:
    with grpc.insecure_channel(target) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def run_on(served, coro):
    return asyncio.run_coroutine_threadsafe(coro, served.loop).result(30)


def test_ready_runs_a_one_token_generation(served):
    before = (
        served.server.metrics.registry.get_sample_value("shinkai_requests_started_total", {"endpoint": "probe"}) or 0
    )
    assert get(served.http_url + "/ready") == (200, {"status": "ok"})
    after = served.server.metrics.registry.get_sample_value("shinkai_requests_started_total", {"endpoint": "probe"})
    assert after == before + 1  # a real request went through the engine


def test_a_dependency_problem_is_503_not_serving_and_unavailable(served):
    api = served.server.api
    run_on(served, api.set_problem("the worker at w:1 is not answering"))
    try:
        assert get(served.http_url + "/health") == (503, {"status": "the worker at w:1 is not answering"})
        assert get(served.http_url + "/ready")[0] == 503
        assert grpc_status(served.grpc_target) == health_pb2.HealthCheckResponse.NOT_SERVING
        with ShinkaiClient(served.grpc_target, timeout=30) as c:
            with pytest.raises(Unavailable, match="worker at w:1"):
                c.generate("Hi", max_tokens=1)
    finally:
        run_on(served, api.set_problem(None))
    assert get(served.http_url + "/health") == (200, {"status": "ok"})
    assert grpc_status(served.grpc_target) == health_pb2.HealthCheckResponse.SERVING


class _FailingStream:
    num_prompt_tokens = 1

    def __aiter__(self):
        return self

    async def __anext__(self):
        from services.engine.service import Delta

        return Delta([], [], None, 0, finish_reason="error")

    def close(self):
        pass


def test_the_probe_names_a_failed_generation(served):
    frontend = served.server.frontend
    real = frontend.engine

    class Broken:
        async def submit(self, *args):
            return _FailingStream()

    frontend.engine = Broken()
    try:
        why = run_on(served, probe(frontend))
    finally:
        frontend.engine = real
    assert why is not None and "'error'" in why
    assert run_on(served, probe(frontend)) is None
