"""Structured output under async scheduling: the mask is a sampler input only, so a constrained step's forward is
queued before the step in flight is read, the matchers advance at that read, and the step samples after it. The
outputs are the synchronous engine's bits in the batch-invariant mode (greedy and seeded, logprobs included); on
CUDA a constrained decode step never synchronises the stream."""

from __future__ import annotations

import contextlib
import json
import re

import pytest
import torch

from services.engine import LLM
from services.engine.finish_reason import FinishReason
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint

pytestmark = pytest.mark.timeout(300)

REGEX = r"[a-c]{2,5}-\d{1,3}"
SHORT = r"(yes|no)"  # ends within a few tokens: its rows in the next, already planned step are dead
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
PROMPTS = ["Hi", "Hello there", "Say it", "Answer:", "ok", "JSON please"]


def _params(temperature: float) -> list[SamplingParams]:
    constraints = [
        Constraint("regex", REGEX),
        Constraint("json_schema", json.dumps(SCHEMA)),
        None,
        Constraint("regex", SHORT),
        Constraint("json_schema", json.dumps(SCHEMA)),
        Constraint("regex", REGEX),
    ]
    return [
        SamplingParams(temperature=temperature, seed=40 + i, max_tokens=40, logprobs=2, constraint=c)
        for i, c in enumerate(constraints)
    ]


def _use(llm: LLM, async_scheduling: bool) -> None:
    llm.engine.config = llm.engine.config.replace(async_scheduling=async_scheduling)


@contextlib.contextmanager
def _async(llm: LLM):
    """Async scheduling within the block; synchronous again after it, also when it raises."""
    _use(llm, True)
    try:
        yield
    finally:
        _use(llm, False)


def _sync_then_async(llm: LLM, prompts: list[str], params: list[SamplingParams]) -> tuple[list, list]:
    """The same requests' outputs from the synchronous engine, then from the async one (left synchronous)."""
    _use(llm, False)
    sync = llm.generate(prompts, params)
    with _async(llm):
        return sync, llm.generate(prompts, params)


@contextlib.contextmanager
def _patched(obj, **methods):
    """Instance attributes over ``obj``'s methods within the block, deleted after it (the class's methods again)."""
    for name, method in methods.items():
        setattr(obj, name, method)
    try:
        yield
    finally:
        for name in methods:
            delattr(obj, name)


def _assert_pools_whole(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots, stats


def _valid(params: SamplingParams, text: str) -> bool:
    c = params.constraint
    if c is None:
        return True
    if c.kind == "regex":
        return re.fullmatch(c.spec, text) is not None
    value = json.loads(text)
    return set(value) == {"name", "n"} and len(value["name"]) <= 12 and 0 <= value["n"] <= 99


@pytest.fixture(scope="module")
def bi():
    return LLM("tiny", max_num_seqs=8, batch_invariant=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_async_gives_the_synchronous_bits_in_the_batch_invariant_mode(bi, temperature):
    params = _params(temperature)
    sync, asynchronous = _sync_then_async(bi, PROMPTS, params)
    for s, a, p in zip(sync, asynchronous, params):
        assert (a.token_ids, a.logprobs, a.top_logprobs) == (s.token_ids, s.logprobs, s.top_logprobs)
        assert a.finish_reason == s.finish_reason
        if p.constraint is not None:
            assert a.finish_reason == FinishReason.STOP and _valid(p, a.text), (a.finish_reason, a.text)
    _assert_pools_whole(bi)


def test_constrained_choices_under_async_give_the_synchronous_bits(bi):
    """n > 1: the prefix forks into choices (each its own matcher) while the next step is launched; every choice is
    the synchronous engine's, beside a plain request."""
    params = [
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=40, logprobs=1, constraint=Constraint("regex", REGEX)),
        SamplingParams(max_tokens=20, seed=1),
    ]
    sync, asynchronous = _sync_then_async(bi, ["Hello there friend", "x"], params)
    assert len(sync) == 4 and [o.index for o in sync[:3]] == [0, 1, 2]
    assert [(o.token_ids, o.logprobs) for o in asynchronous] == [(o.token_ids, o.logprobs) for o in sync]
    assert all(o.finish_reason == FinishReason.STOP and re.fullmatch(REGEX, o.text) for o in asynchronous[:3])


def test_a_constrained_step_is_launched_before_the_step_in_flight_is_read_and_sampled_after(bi):
    """The order of the worker's calls: step N+1's forward is launched before step N's tokens are read (the
    overlap), and N+1 samples only after that read (its mask needs N's tokens in the matchers)."""
    engine = bi.engine
    events: list[tuple[str, int]] = []
    prefills: set[int] = set()  # prefill steps are read right after they run (drained), by design
    launch, sample = engine.worker.launch, engine.worker.sample

    def launching(plan, *args, **kwargs):
        events.append(("launch", plan.step_id))
        if plan.is_prefill:
            prefills.add(plan.step_id)
        return launch(plan, *args, **kwargs)

    def sampling(step, token_bitmask=None):
        events.append(("sample", step.plan.step_id))
        out = sample(step, token_bitmask)
        # The read-back the engine's update triggers, traced.
        out.on_read_back(lambda step_id=step.plan.step_id: events.append(("read", step_id)))
        return out

    with _patched(engine.worker, launch=launching, sample=sampling), _async(bi):
        outs = bi.generate(PROMPTS[:2], _params(1.0)[:2])
    assert all(o.finish_reason == FinishReason.STOP for o in outs)
    at = {e: i for i, e in enumerate(events)}
    overlapped = 0
    for kind, step_id in events:
        if kind != "read" or step_id in prefills or ("launch", step_id + 1) not in at:
            continue
        assert at[("launch", step_id + 1)] < at[("read", step_id)] < at[("sample", step_id + 1)], events
        overlapped += 1
    assert overlapped >= 5, events


def test_a_synchronous_constrained_step_fills_its_mask_after_launching_its_forward(bi):
    """Without async scheduling too, the mask is a sampler input only: each step's forward is launched, then its
    mask filled (on a GPU, while the forward runs), then it is sampled."""
    engine = bi.engine
    events: list[tuple[str, int]] = []
    launch, sample, fill = engine.worker.launch, engine.worker.sample, engine.structured.token_bitmask

    def launching(plan, *args, **kwargs):
        events.append(("launch", plan.step_id))
        return launch(plan, *args, **kwargs)

    def sampling(step, token_bitmask=None):
        events.append(("sample", step.plan.step_id))
        return sample(step, token_bitmask)

    def filling(plan, requests):
        events.append(("fill", plan.step_id))
        return fill(plan, requests)

    _use(bi, False)
    with _patched(engine.worker, launch=launching, sample=sampling), _patched(engine.structured, token_bitmask=filling):
        outs = bi.generate(PROMPTS[:2], _params(1.0)[:2])
    assert all(o.finish_reason == FinishReason.STOP for o in outs)
    step_ids = [step_id for kind, step_id in events if kind == "launch"]
    assert len(step_ids) >= 5 and events == [(kind, i) for i in step_ids for kind in ("launch", "fill", "sample")]
    _assert_pools_whole(bi)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_constrained_async_decode_steps_never_synchronise_the_stream():
    """CUDA's sync debug mode raises on any wait for the stream: a constrained async decode step reads the step in
    flight through its host copy's event and uploads its mask pinned, so none may wait. The outputs match the
    synchronous engine's (batch-invariant mode, the kernel backend with decode graphs)."""
    llm = LLM(model="tiny", device="cuda", block_size=16, max_num_seqs=8, batch_invariant=True)
    engine = llm.engine
    assert engine.config.async_scheduling and engine.config.cuda_graphs
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=80, constraint=Constraint("regex", "[a-z]{60,72}"))
        for i in range(4)
    ]
    prompts = PROMPTS[:4]
    _use(llm, False)
    sync = llm.generate(prompts, params)  # also compiles every kernel and the grammar
    _use(llm, True)
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"c{i}", llm.encode(prompt), p)
    done = {o.request_id: o for o in engine.step() if o.finished}  # the prefill (eager, drained)
    # Until a decode step of all four has been read back: the steps after it are async decode steps alone.
    while engine.last_plan.is_prefill or engine.last_plan.num_requests < 4:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    except RuntimeError as err:
        raise AssertionError(f"a constrained step synchronised; the last plan {engine.last_plan}") from err
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [done[f"c{i}"].token_ids for i in range(4)] == [o.token_ids for o in sync]
    assert all(re.fullmatch("[a-z]{60,72}", llm.tokenizer.decode(o.token_ids)) for o in sync)


def test_a_failed_constrained_async_step_ends_every_request_with_error_and_leaks_nothing():
    """The step's sampling fails after the step in flight was read (a launched step never sampled): every live
    request ends with one final "error" delta, the pools come back whole, and the engine serves again."""
    import asyncio

    from services.engine.remote.remote_worker import WorkerLost
    from services.engine.service import EngineService

    llm = LLM("tiny", max_num_seqs=8, async_scheduling=True)
    worker = llm.engine.worker
    sample, broken = worker.sample, []

    def flaky(step, token_bitmask=None):
        if broken and step.plan.num_requests:
            raise WorkerLost("the worker failed the step's sampling")
        return sample(step, token_bitmask)

    service = EngineService(llm.engine)
    long = SamplingParams(max_tokens=200, constraint=Constraint("regex", "[a-z]{150,190}"))

    async def run():
        streams = [service.submit(f"r{i}", f"r{i}", llm.encode(f"Hello {i}"), long) for i in range(4)]
        for s in streams:  # all running: each has produced a token
            assert (await s.__anext__()).finish_reason is None
        broken.append(True)
        finals = []
        for s in streams:
            deltas = [d async for d in s]
            finals.append(deltas[-1].finish_reason)
        broken.clear()
        again = [d async for d in service.submit("after", "after", llm.encode("Hi"), SamplingParams(max_tokens=3))]
        return finals, again[-1].finish_reason

    with _patched(worker, sample=flaky):
        service.start()
        try:
            finals, after = asyncio.run(run())
        finally:
            service.stop()
    assert finals == ["error"] * 4 and after == "length"
    _assert_pools_whole(llm)
    llm.engine.scheduler.check_invariants()
