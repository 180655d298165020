"""schemathesis against the served /openapi.json: no 5xx, no undocumented status code, no response that breaks
its schema or content type, for a bounded number of generated requests per operation.

The server has a 64-token context so every generated generation is short; the schema's limits follow it."""

import itertools

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from services.gateway.openai.protocol import MAX_N
from services.gateway.server import ServeConfig
from tests.services.gateway.conftest import ServerThread, pools_whole

pytestmark = pytest.mark.timeout(300)
MAX_EXAMPLES = 20  # per operation and mode: nine operations, the four POSTs in both modes
# Bodies the schema accepts, and bodies it refuses (each must be a documented 4xx, never a 5xx).
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def fuzz_server():
    thread = ServerThread(
        ServeConfig(
            model="tiny",
            http_port=0,
            grpc_port=0,
            drain_timeout_s=5,
            engine_args={"max_num_seqs": 8, "max_model_len": 64},
        )
    ).start()
    yield thread
    thread.stop()
    assert pools_whole(thread.server.engine.stats())


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(fuzz_server.http_url + "/openapi.json")


def test_the_served_api_keeps_its_description(api_schema):
    """Each operation's generated cases, called and checked (schemathesis' pytest plugin predates this pytest,
    so hypothesis drives its strategies directly)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 9
    for operation, mode in itertools.product(operations, MODES):
        if mode == schemathesis.GenerationMode.NEGATIVE and operation.method.lower() != "post":
            continue  # a GET without parameters has nothing to get wrong

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def call(case):
            case.call_and_validate(checks=CHECKS, timeout=60)

        call()


def test_the_description_is_served_with_the_models_limits(api_schema, fuzz_server):
    raw = api_schema.raw_schema
    completion = raw["components"]["schemas"]["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["maximum"] == 64
    assert raw["components"]["schemas"]["ChatCompletionRequest"]["properties"]["n"]["maximum"] == MAX_N
    assert set(raw["paths"]) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/version",
        "/health",
        "/ready",
        "/metrics",
    }
