"""shinkai.v1 over gRPC through the sync and asyncio clients: streaming, abort, timeouts, info, loads."""

import asyncio
import threading

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.client import AsyncShinkaiClient, ShinkaiClient, Timeout
from services.engine import SamplingParams
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from tests.services.gateway.support import generate, refusal, wait_whole

pytestmark = pytest.mark.timeout(120)


def test_stream_text_equals_llm_generate(grpc_client, reference_llm):
    deltas = list(grpc_client.generate_stream("Hello", max_tokens=4, seed=11))
    expected = reference_llm.generate("Hello", SamplingParams(max_tokens=4, seed=11))[0]
    assert "".join(d.text for d in deltas) == expected.text
    assert [t for d in deltas for t in d.token_ids] == expected.token_ids
    assert deltas[-1].finish_reason == "length" and all(d.finish_reason is None for d in deltas[:-1])
    done = grpc_client.generate([0, 19923], max_tokens=2, temperature=0)
    assert done.completion_tokens == 2 and done.prompt_tokens == 2 and done.finish_reason == "length"


def test_the_client_returns_the_logprobs_it_asked_for(grpc_client, reference_llm):
    """logprobs through the Python client: each token's logprob and top-n, streamed and whole, equal to
    LLM.generate's (float32 over the wire); the usage's cached tokens reach the Completion."""
    params = SamplingParams(max_tokens=4, seed=12, logprobs=3)
    expected = reference_llm.generate("Hello there", params)[0]
    done = grpc_client.generate("Hello there", max_tokens=4, seed=12, logprobs=3)
    deltas = list(grpc_client.generate_stream("Hello there", max_tokens=4, seed=12, logprobs=3))
    f32 = [float(np.float32(v)) for v in expected.logprobs]
    tops = [[(i, float(np.float32(v))) for i, v in top] for top in expected.top_logprobs]
    assert done.logprobs == [v for d in deltas for v in d.logprobs] == f32 and len(f32) == 4
    assert done.top_logprobs == [t for d in deltas for t in d.top_logprobs] == tops
    assert all(len(top) == 3 for top in tops)
    assert grpc_client.generate("Hello there", max_tokens=1).cached_tokens > 0  # the same prompt again


def test_chat_through_grpc_matches_http_rendering(grpc_client, served, reference_llm):
    messages = [{"role": "user", "content": "Hello"}]
    done = grpc_client.generate(messages=messages, max_tokens=2, seed=4, thinking=False)
    ids = served.server.chat.render({"messages": messages, "thinking": {"type": "disabled"}}).token_ids
    assert ids[-1] == 128822 and done.prompt_tokens == len(ids)  # </think>: thinking off
    assert done.text == reference_llm.generate([ids], SamplingParams(max_tokens=2, seed=4))[0].text
    default = grpc_client.generate(messages=messages, max_tokens=1)  # unset: the model's default, thinking on
    thinking = served.server.chat.render({"messages": messages}).token_ids
    assert thinking[-1] == 128821 and default.prompt_tokens == len(thinking)


def test_abort_ends_a_live_stream_and_is_idempotent(grpc_client, served):
    stream = grpc_client.generate_stream("Hello", max_tokens=1000, ignore_eos=True, client_request_id="to-abort")
    first = next(stream)
    assert first.client_request_id == "to-abort" and first.finish_reason is None
    assert grpc_client.abort("to-abort") is True
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    assert sum(len(d.token_ids) for d in [first, *rest]) < 1000
    assert grpc_client.abort("to-abort") is False
    assert grpc_client.abort("unknown-id") is False
    wait_whole(served)


def test_cancelled_stream_aborts_the_request(served):
    async def run():
        async with AsyncShinkaiClient(served.grpc_target) as c:
            async for delta in c.generate_stream("Hello", max_tokens=1000, ignore_eos=True):
                assert delta.finish_reason is None
                break  # leaving the loop cancels the call

    asyncio.run(run())
    wait_whole(served)


def test_timeout_raises_and_aborts(grpc_client, served):
    with pytest.raises(Timeout):
        grpc_client.generate("Hello", max_tokens=1000, ignore_eos=True, timeout=0.5)
    wait_whole(served)


def test_same_client_request_id_twice_does_not_collide(served):
    with ShinkaiClient(served.grpc_target, timeout=60) as c:
        results = [None, None]

        def run(i):
            results[i] = c.generate(f"p{i}", max_tokens=3, client_request_id="shared", temperature=0)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert [r.completion_tokens for r in results] == [3, 3]


def test_the_server_makes_the_request_id_and_echoes_the_client_request_id(grpc_client, served):
    done = grpc_client.generate("Hi", max_tokens=1, client_request_id="mine")
    assert done.client_request_id == "mine" and done.request_id.startswith("req-")
    # Without a client_request_id (a raw request: the clients always send one), the request_id stands in.
    responses = generate(served.grpc_target, pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=1)))
    ids = {(r.request_id, r.client_request_id) for r in responses}
    assert len(ids) == 1 and next(iter(ids))[0] == next(iter(ids))[1] != ""


def test_a_client_cannot_choose_the_request_id(served):
    request = pb.GenerateRequest(text="Hi", request_id="mine", sampling=pb.SamplingParams(max_tokens=1))
    err = refusal(served.grpc_target, request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("request_id is made by the server; name a request with client_request_id")


def test_model_info_loads_and_health(grpc_client, served):
    info = grpc_client.model_info()
    assert info.model == "tiny" and info.vocab_size == 129280 and info.max_model_len == 4096
    # What a gateway hashes prompts with to route by cached prefix: the block size, and the image placeholder
    # (tiny has a vision tower) before which a prompt's blocks are the same after the engine expands images.
    assert info.block_size == 128 and info.image_placeholder_id == 129279
    loads = grpc_client.loads()
    assert len(loads.engines) == 1 and loads.engines[0].num_total_blocks > 0
    assert loads.engines[0].replica == served.server.config.replica == "engine-0"
    with grpc.insecure_channel(served.grpc_target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "shinkai.v1.Shinkai"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_priority_reaches_the_engine(grpc_client, served, monkeypatch):
    """GenerateRequest.priority goes through the gateway to the engine's queue (EngineService.submit)."""
    service = served.server.engine
    submit, seen = service.submit, []

    def recording(*args, priority=0, **kwargs):
        seen.append(priority)
        return submit(*args, priority=priority, **kwargs)

    monkeypatch.setattr(service, "submit", recording)
    done = grpc_client.generate([0, 19923], max_tokens=2, temperature=0, priority=-4)
    assert done.completion_tokens == 2 and seen == [-4]
