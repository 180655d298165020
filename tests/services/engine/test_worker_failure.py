"""A worker that fails a step (its process died, it stopped answering its heartbeat): every live request
ends with one final "error" delta, and the scheduler's pools come back whole, including the blocks whose
release waited for the failed step. The engine then serves again once the worker does."""

import asyncio

import pytest

from services.engine import LLM, SamplingParams
from services.engine.remote.remote_worker import WorkerLost
from services.engine.service import EngineService

pytestmark = pytest.mark.timeout(120)


class FlakyWorker:
    """The real worker, except that ``execute`` raises while ``broken`` is set (like a lost remote worker)."""

    def __init__(self, inner):
        self.inner = inner
        self.broken = False
        self.num_failed = 0

    def execute(self, plan, rows):
        if self.broken and plan.num_requests:
            self.num_failed += 1
            raise WorkerLost("the worker at test:0 failed step: UNAVAILABLE")
        return self.inner.execute(plan, rows)

    def release(self, request_id):
        self.inner.release(request_id)

    in_process = False  # its execute takes the plan and rows only

    @property
    def num_losses(self):
        return self.inner.num_losses


def test_a_failed_step_ends_every_request_with_error_and_leaks_nothing():
    llm = LLM("tiny")
    worker = FlakyWorker(llm.engine.worker)
    llm.engine.worker = worker
    service = EngineService(llm.engine)
    service.start()
    long = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        streams = [service.submit(f"r{i}", f"r{i}", llm.encode(f"Hello {i}"), long) for i in range(6)]
        for s in streams:  # all running: each has produced a token
            assert (await s.__anext__()).finish_reason is None
        worker.broken = True
        finals = []
        for s in streams:
            deltas = [d async for d in s]
            finals.append(deltas[-1].finish_reason)
            assert all(d.finish_reason is None for d in deltas[:-1])
        worker.broken = False
        again = [d async for d in service.submit("after", "after", llm.encode("Hi"), SamplingParams(max_tokens=3))]
        return finals, again[-1].finish_reason

    try:
        finals, after = asyncio.run(run())
    finally:
        service.stop()
    assert finals == ["error"] * 6 and worker.num_failed >= 1
    assert after == "length"
    stats = llm.engine.stats()
    assert stats.free_blocks == stats.total_blocks, stats
    assert stats.free_state_slots == stats.total_state_slots, stats
    llm.engine.scheduler.check_invariants()


def test_ending_every_request_at_once_gives_back_what_each_held():
    """``Engine.end_all`` (a failed step's stream ends, a lost data-parallel group) gives back, beside the blocks,
    each request's hash chain, grammar-gate entry and penalty slot, as a request's own finish does."""
    from services.engine.structured.constraint import Constraint

    llm = LLM("tiny", max_num_seqs=4)
    engine = llm.engine
    penalised = SamplingParams(max_tokens=50, ignore_eos=True, presence_penalty=0.5)
    constrained = SamplingParams(max_tokens=50, constraint=Constraint("regex", "[a-z]{40}"))
    engine.add_request("pen", llm.encode("Hello there"), penalised)
    engine.add_request("json", llm.encode("Say a word"), constrained)
    engine.add_request("waits", llm.encode("Queued"), penalised)
    for _ in range(3):
        engine.step()
    assert engine.hashes is not None and len(engine.hashes) == 3
    assert engine.ends.histories.num_held == 2
    ended = engine.end_all()
    assert sorted(ended) == ["json", "pen", "waits"]
    assert len(engine.hashes) == 0
    assert engine.ends.histories.num_held == 0
    assert not engine.structured.gate
    assert not engine.has_unfinished()
    stats = engine.stats()
    assert stats.free_state_slots == stats.total_state_slots, stats
    engine.scheduler.check_invariants()
