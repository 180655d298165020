"""The waiting queue's one order through the engine's APIs: the tenant served least, then priority (lower
first), then arrival; a bad priority is refused by name; gRPC's ``GenerateRequest.priority`` and ``tenant``
reach the request's arguments."""

from __future__ import annotations

import pytest

from services.engine import LLM, SamplingParams
from services.gateway.grpc_api import _args
from services.proto.shinkai.v1 import shinkai_pb2 as pb


def one_at_a_time(source) -> tuple[LLM, list[str]]:
    """An engine that runs one request at a time (max_num_seqs 1), so the order in which requests first reach
    the worker (the list, filled as they do) is the queue's."""
    llm = LLM(source=source, device="cpu", max_model_len=64, block_size=8, max_num_seqs=1)
    order: list[str] = []
    execute = llm.engine.worker.execute

    def recording(plan, rows, previous=None):
        order.extend(r for r in plan.request_ids if r not in order)
        return execute(plan, rows, previous)

    llm.engine.worker.execute = recording
    return llm, order


def test_generate_serves_prompts_by_priority_then_arrival(draft_source):
    llm, order = one_at_a_time(draft_source)
    prompts = [[0, 3 + k, 4 + k] for k in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=2), priority=[2, 0, -1, 0])
    assert [o.request_id for o in outs] == ["0", "1", "2", "3"]
    assert order == ["2", "1", "3", "0"]


def test_a_bad_priority_is_refused_before_anything_is_queued(draft_source):
    llm = LLM(source=draft_source, device="cpu", max_model_len=64, block_size=8, max_num_seqs=2)
    for bad in (2**31, True, 1.5):
        with pytest.raises(ValueError, match="priority must be an integer"):
            llm.generate([[0, 3]], SamplingParams(max_tokens=1), priority=bad)
    with pytest.raises(ValueError, match="2 priorities for 1 prompts"):
        llm.generate([[0, 3]], SamplingParams(max_tokens=1), priority=[0, 1])
    assert not llm.engine.has_unfinished()


def test_grpc_priority_reaches_the_request():
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5]), priority=-7)
    assert _args(request)[0].priority == -7
    assert _args(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5])))[0].priority == 0


def test_the_queue_goes_first_by_the_tenant_served_least(draft_source):
    """One tenant queues three prompts, another one after them: the second tenant's runs second (its tenant has
    had no service when the first tenant's first prompt has), not last; with one tenant it runs last."""

    def order_of(light_tenant: str) -> list[str]:
        llm, order = one_at_a_time(draft_source)
        params = SamplingParams(max_tokens=2)
        for k in range(3):
            llm.engine.add_request(f"heavy{k}", [0, 3 + k, 4 + k], params, tenant="heavy")
        llm.engine.add_request("light", [0, 9, 10], params, tenant=light_tenant)
        assert llm.engine.scheduler.request("light").tenant == light_tenant
        while llm.engine.has_unfinished():
            llm.engine.step()
        return order

    assert order_of("light") == ["heavy0", "light", "heavy1", "heavy2"]
    assert order_of("heavy") == ["heavy0", "heavy1", "heavy2", "light"]


def test_grpc_tenant_reaches_the_request():
    assert _args(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5]), tenant="k1"))[0].tenant == "k1"
    assert _args(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[0, 5])))[0].tenant is None
