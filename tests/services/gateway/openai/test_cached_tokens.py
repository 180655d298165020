"""Prefix caching as a client sees it: ``usage.prompt_tokens_details.cached_tokens`` in OpenAI responses (and in
the gRPC final's usage), vLLM's ``cache_salt`` keeping salted requests apart, and the prefix-cache counters on
/metrics. The engine's default block is 128 tokens: a 300-token prompt ends 44 tokens into its third block."""

import json

import grpc
import pytest

from services.proto.shinkai.v1 import shinkai_pb2 as pb
from services.proto.shinkai.v1 import shinkai_pb2_grpc as pb_grpc
from tests.services.gateway.test_contract import raw_request

pytestmark = pytest.mark.timeout(120)
PROMPT = [5 + (i * 37) % 1000 for i in range(300)]


def _complete(served, prompt: list[int], **fields) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2, "temperature": 0, **fields}
    status, data, _ = raw_request(
        served.http_url, "POST", "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    assert status == 200, data[:300]
    return json.loads(data)["usage"]


def test_a_longer_prompt_reports_the_tokens_it_took_from_the_cache(served):
    first = _complete(served, PROMPT, cache_salt="cached-tokens-test")
    assert first["prompt_tokens_details"] == {"cached_tokens": 0}
    # The first prompt's end was snapshotted: a prompt that extends it resumes there.
    longer = PROMPT + [7] * 20
    assert _complete(served, longer, cache_salt="cached-tokens-test")["prompt_tokens_details"]["cached_tokens"] == 300
    # Another salt shares nothing.
    assert _complete(served, longer, cache_salt="another-tenant")["prompt_tokens_details"]["cached_tokens"] == 0
    status, data, _ = raw_request(served.http_url, "GET", "/metrics")
    text = data.decode()
    assert status == 200 and "vllm:prefix_cache_hits_total" in text and "vllm:prefix_cache_queries_total" in text
    hits = [line for line in text.splitlines() if line.startswith("shinkai_engine_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 300


def test_grpc_finals_carry_the_cached_tokens(served):
    salt = "cached-tokens-grpc"
    with grpc.insecure_channel(served.grpc_target) as channel:
        stub = pb_grpc.ShinkaiStub(channel)

        def cached(prompt: list[int]) -> int:
            request = pb.GenerateRequest(
                model="tiny",
                token_ids=pb.TokenIds(ids=prompt),
                sampling=pb.SamplingParams(max_tokens=2, temperature=0, cache_salt=salt),
            )
            finals = [r.final for r in stub.Generate(request, timeout=60) if r.WhichOneof("kind") == "final"]
            return finals[-1].usage.cached_tokens

        assert cached(PROMPT[:260]) == 0
        assert cached(PROMPT[:260] + [9] * 10) == 260
