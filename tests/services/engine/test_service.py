"""EngineService: the step-loop thread behind per-request asyncio streams."""

import asyncio

import pytest

from services.engine import LLM, SamplingParams
from services.engine.service import EngineService, QueueFull

pytestmark = pytest.mark.timeout(120)


# Batch-invariant mode (docs/batch-invariance.md): the service's step loop batches the streams in other
# steps than LLM.generate does, and in this mode that cannot move a bit, so logprobs compare under ==.
@pytest.fixture(scope="module")
def llm():
    return LLM("tiny", batch_invariant=True)


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", batch_invariant=True)  # driven synchronously by LLM.generate, never by a service


@pytest.fixture
def service(llm):
    svc = EngineService(llm.engine, max_queued=8)
    svc.start()
    yield svc
    svc.stop()
    stats = llm.engine.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots


async def collect(stream):
    return [d async for d in stream]


def test_streams_match_llm_generate_for_the_same_seed(service, llm, reference):
    prompts = [llm.encode("Hello"), llm.encode("The sea")]
    params = [SamplingParams(max_tokens=3, seed=7), SamplingParams(max_tokens=2, temperature=0)]

    async def run():
        # Client request ids may repeat; request ids are unique.
        streams = [service.submit(f"r{i}", "same-id", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(run())
    expected = reference.generate(prompts, params)
    for deltas, out in zip(results, expected):
        assert [t for d in deltas for t in d.token_ids] == out.token_ids
        assert [x for d in deltas for x in d.logprobs] == out.logprobs
        assert [d.finish_reason for d in deltas][-1] == out.finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[-1].num_output_tokens == len(out.token_ids)


def test_closing_a_stream_aborts_it_and_returns_its_blocks(service, llm):
    async def run():
        stream = service.submit("c", "c", llm.encode("Hello"), SamplingParams(max_tokens=500, ignore_eos=True))
        first = await stream.__anext__()
        assert first.token_ids and first.finish_reason is None
        stream.close()
        for _ in range(200):
            stats = service.stats()  # a snapshot taken after the step thread's latest iteration
            if service.num_unfinished() == 0 and stats.free_blocks == stats.total_blocks:
                return stats
            await asyncio.sleep(0.05)
        raise AssertionError(f"the closed stream's request never ended: {service.stats()}")

    stats = asyncio.run(run())
    assert stats.num_running == stats.num_waiting == 0
    assert stats.free_state_slots == stats.total_state_slots


def test_abort_by_client_request_id_ends_every_live_request_with_it(service, llm):
    async def run():
        a = service.submit("a", "dup", llm.encode("A"), SamplingParams(max_tokens=500, ignore_eos=True))
        b = service.submit("b", "dup", llm.encode("B"), SamplingParams(max_tokens=500, ignore_eos=True))
        assert a.request_id != b.request_id
        await a.__anext__()
        assert service.abort("dup") is True
        finals = [(await collect(s))[-1] for s in (a, b)]
        assert service.abort("dup") is False  # idempotent: nothing live any more
        assert service.abort("never-seen") is False
        return finals

    finals = asyncio.run(run())
    assert [f.finish_reason for f in finals] == ["abort", "abort"]


def test_a_request_id_already_live_is_refused(service, llm):
    async def run():
        live = service.submit("gw-1", "a", llm.encode("A"), SamplingParams(max_tokens=500, ignore_eos=True))
        with pytest.raises(ValueError, match="request id 'gw-1' is already in use"):
            service.submit("gw-1", "b", llm.encode("B"), SamplingParams(max_tokens=1))
        assert service.num_unfinished() == 1  # nothing of the refused one was queued
        live.close()
        return await collect(live)

    assert asyncio.run(run())[-1].finish_reason == "abort"


def test_queue_full_and_bad_input_are_refused_before_queueing(service, llm):
    async def run():
        streams = [service.submit(str(i), str(i), llm.encode("x"), SamplingParams(max_tokens=1)) for i in range(8)]
        with pytest.raises(QueueFull):
            service.submit("9", "9", llm.encode("x"), SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="empty"):
            service.submit("e", "e", [], SamplingParams())
        with pytest.raises(ValueError, match="outside the vocabulary"):
            service.submit("v", "v", [10**9], SamplingParams())
        return await asyncio.gather(*(collect(s) for s in streams))

    results = asyncio.run(run())
    assert all(r[-1].finish_reason == "length" and r[-1].num_output_tokens == 1 for r in results)


def test_a_stream_of_n_choices_carries_each_and_ends_after_the_last(service, llm, reference):
    prompt = llm.encode("The sea is deep")
    params = SamplingParams(max_tokens=4, seed=3, n=3, ignore_eos=True)

    async def run():
        return await collect(service.submit("n3", "n3", prompt, params))

    deltas = asyncio.run(run())
    expected = reference.generate([prompt], params)
    for out in expected:
        mine = [d for d in deltas if d.index == out.index]
        assert [t for d in mine for t in d.token_ids] == out.token_ids
        assert [x for d in mine for x in d.logprobs] == out.logprobs
        assert mine[-1].finish_reason == "length"
    assert [d.last for d in deltas] == [False] * (len(deltas) - 1) + [True]


def test_aborting_a_stream_of_n_choices_ends_it(service, llm):
    async def run():
        stream = service.submit("n2", "n2", llm.encode("A"), SamplingParams(max_tokens=500, n=2, ignore_eos=True))
        await stream.__anext__()
        assert service.abort("n2") is True
        return await collect(stream)

    rest = asyncio.run(run())
    assert rest[-1].last and rest[-1].finish_reason == "abort"
