"""Async scheduling on CPU: the same tokens and logprobs with it on and off, over a
mixed batch (prompt lengths, max_tokens, a stop token, an abort mid-run, greedy and seeded sampling), whole
pools and scheduler invariants after every step, and proof that step N+1 is planned before N is updated."""

import pytest
import torch

from scheduler_rs import StepResult
from services.engine import LLM, SamplingParams
from services.engine.engine import Engine


@pytest.fixture(scope="module")
def llm():
    # Batch-invariant: a request that ended at step N still has its (dropped) row in N+1 with async on, so
    # the two runs' batches differ; in this mode that cannot move a bit (model/batch_invariant.py).
    return LLM(model="tiny", block_size=16, max_num_batched_tokens=64, max_num_seqs=16, batch_invariant=True)


def _prompt(seed, n):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 129_000, (n,), generator=g).tolist()


def _all_fives(plan) -> StepResult:
    """One token (5) for every planned request."""
    return StepResult([1] * plan.num_requests, [5] * plan.num_requests)


def _use(llm, async_scheduling: bool) -> Engine:
    engine = llm.engine
    engine.config = engine.config.replace(async_scheduling=async_scheduling)
    return engine


def _run(engine: Engine, requests, abort_after: dict[str, int]) -> dict[str, tuple]:
    """Runs the requests to the end, checking the scheduler after every step; aborts a request once it
    has ``abort_after[id]`` tokens. Returns id → (tokens, logprobs, top logprobs, finish reason)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.scheduler.check_invariants()
        for request_id, n in abort_after.items():
            live = engine.requests.get(request_id) if request_id not in done else None
            if live is not None and len(live.output.token_ids) >= n:
                done[request_id] = engine.abort(request_id)
                engine.scheduler.check_invariants()
    s = engine.stats()
    assert s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots
    assert s.num_waiting == s.num_running == 0
    return {
        request_id: (out.token_ids, out.logprobs, out.top_logprobs, out.finish_reason)
        for request_id, out in done.items()
    }


def _mixed(tag: str, sampling: dict, stop: int | None):
    lengths = [5, 23, 40, 9, 70, 17]
    max_tokens = [6, 3, 9, 12, 5, 10]
    requests = []
    for k, (n, m) in enumerate(zip(lengths, max_tokens)):
        params = SamplingParams(
            max_tokens=m,
            ignore_eos=True,
            seed=100 + k,
            logprobs=2 if k % 2 else None,
            stop_token_ids=(stop,) if (k == 3 and stop is not None) else (),
            **sampling,
        )
        requests.append((f"{tag}{k}", _prompt(k, n), params))
    return requests


@pytest.mark.parametrize(
    "sampling", [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, top_k=50)], ids=["greedy", "seeded"]
)
def test_async_on_and_off_give_identical_tokens_and_logprobs(llm, sampling):
    # Request 3 runs to 12 tokens once, then its 4th token becomes its stop token: it ends early.
    probe = _run(_use(llm, False), _mixed("p", sampling, None)[3:4], {})
    stop = probe["p3"][0][3]
    abort_after = {"{}5": 4}
    results = {}
    for flag in (False, True):
        tag = "a" if flag else "s"
        results[flag] = _run(
            _use(llm, flag), _mixed(tag, sampling, stop), {k.format(tag): v for k, v in abort_after.items()}
        )
    sync, asyn = results[False], results[True]
    for k in range(6):
        (tokens, lps, tops, reason), (a_tokens, a_lps, a_tops, a_reason) = sync[f"s{k}"], asyn[f"a{k}"]
        assert (a_tokens, a_reason, a_lps, a_tops) == (tokens, reason, lps, tops)
    reasons = [sync[f"s{k}"][3] for k in range(6)]
    assert reasons == ["length", "length", "length", "stop", "length", "abort"]
    assert sync["s3"][0][-1] == stop and len(sync["s3"][0]) <= 4
    assert len(sync["s5"][0]) == 4
    _use(llm, False)


class _Recorder:
    """The scheduler, with its schedule and update calls recorded in order."""

    def __init__(self, scheduler, calls):
        self._s, self.calls = scheduler, calls

    def schedule(self):
        plan = self._s.schedule()
        self.calls.append(("schedule", plan.step_id, plan.kind))
        return plan

    def update(self, plan, result):
        self.calls.append(("update", plan.step_id, plan.kind))
        return self._s.update(plan, result)

    def __getattr__(self, name):
        return getattr(self._s, name)


def test_async_plans_the_next_decode_step_before_updating_the_one_in_flight(llm):
    engine = _use(llm, True)
    real = engine.scheduler
    calls = []
    engine.scheduler = _Recorder(real, calls)
    try:
        engine.add_request("o1", _prompt(1, 12), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
            real.check_invariants()
    finally:
        engine.scheduler = real
        _use(llm, False)
    overlapped = [
        (a[1], b[1])
        for a, b in zip(calls, calls[1:])
        if a[0] == "schedule" and b[0] == "update" and a[1] > b[1] and b[2] == "decode"
    ]
    assert overlapped, calls  # schedule(N+1) came before update(N) for decode steps
    updated = [c[1] for c in calls if c[0] == "update"]
    assert updated == sorted(updated)  # updates in plan order
    assert calls[:2] == [("schedule", calls[0][1], "prefill"), ("update", calls[0][1], "prefill")]  # drained
    s = engine.stats()
    assert s.free_blocks == s.total_blocks


def test_runner_still_refuses_pending_inputs_without_the_previous_tokens(llm):
    engine = llm.engine
    engine.add_request("r1", _prompt(2, 8), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    first = engine.scheduler.schedule()  # the prefill
    engine.scheduler.update(first, engine.worker.execute(first, engine.inputs.rows(first)).result)
    n = engine.scheduler.schedule()
    n1 = engine.scheduler.schedule()
    assert n1.inputs_pending.tolist() == [1]
    with pytest.raises(ValueError, match="async scheduling"):
        engine.worker.runner.execute(n1)
    engine.scheduler.update(n, _all_fives(n))
    engine.scheduler.update(n1, _all_fives(n1))
    engine.abort("r1")
    assert not engine.has_unfinished()
    s = engine.stats()
    assert s.free_blocks == s.total_blocks


def test_pending_inputs_are_matched_by_request_id_not_batch_position(llm):
    from services.worker.batch.step_batch import PendingInputs, StepBatch

    engine = llm.engine
    for request_id, n in (("x", 5), ("y", 9)):
        engine.add_request(request_id, _prompt(n, n), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    first = engine.scheduler.schedule()
    engine.scheduler.update(first, engine.worker.execute(first, engine.inputs.rows(first)).result)
    n = engine.scheduler.schedule()
    n1 = engine.scheduler.schedule()
    assert n1.inputs_pending.tolist() == [1, 1]
    batch = StepBatch.from_plan(n1)
    order = list(n1.request_ids)
    token = {"x": 111, "y": 222}
    batch.fill_pending(n1, PendingInputs(order[::-1], torch.tensor([token[r] for r in order[::-1]])))
    assert batch.input_ids[batch.query_start[:-1]].tolist() == [token[r] for r in order]
    engine.scheduler.update(n, _all_fives(n))
    engine.scheduler.update(n1, _all_fives(n1))
    for request_id in ("x", "y"):
        engine.abort(request_id)
    s = engine.stats()
    assert s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots


def test_a_step_is_read_back_only_after_the_next_is_queued(llm):
    """The overlap async scheduling exists for: in the engine's order of calls, step N's tokens are read
    back (``WorkerOutput.result``, the one device → host copy of a step) after step N+1 has been executed
    (queued, on a GPU), never before. Recorded through the worker's own outputs."""
    from services.worker.worker_output import WorkerOutput

    engine = _use(llm, True)
    events: list[tuple[str, int]] = []
    execute = engine.worker.execute

    def recording(plan, rows, previous=None):
        out = execute(plan, rows, previous)
        events.append(("executed", plan.step_id))
        assert isinstance(out, WorkerOutput)
        out.on_read_back(lambda step_id=plan.step_id: events.append(("read", step_id)))
        return out

    engine.worker.execute = recording
    try:
        _run(
            engine,
            [
                ("a", _prompt(1, 12), SamplingParams(max_tokens=8, ignore_eos=True)),
                ("b", _prompt(2, 30), SamplingParams(max_tokens=6, ignore_eos=True, seed=3)),
            ],
            {},
        )
    finally:
        del engine.worker.execute
        _use(llm, False)
    decode_reads = [sid for kind, sid in events if kind == "read"]
    assert len(decode_reads) >= 6
    position = {e: i for i, e in enumerate(events)}
    overlapped = 0
    for sid in decode_reads:
        later = [s for kind, s in events if kind == "executed" and s > sid]
        if later:  # every step but the last: its successor is queued before it is read
            nxt = min(later)
            if position[("executed", nxt)] < position[("read", sid)]:
                overlapped += 1
    # Prefill steps are drained (read right after they run); every decode step with a successor overlaps.
    assert overlapped >= 5, events


HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")


def test_no_host_read_of_a_step_after_the_next_is_queued(llm):
    """What makes the overlap real on a GPU: a host read of a device tensor (``tolist``, ``item``, ``cpu``…)
    waits for everything queued on the stream, so reading step N's samples after step N+1 is queued waits
    for N+1 too, and the device idles while the host updates N and plans N+2. Every tensor a step's worker
    output holds (samples, last tokens, expert counts) is marked when the next step's ``execute`` starts;
    no host read may touch a marked tensor's storage after that (reads go through the copies queued with
    the step, services/worker/host_copy.py)."""
    from torch.overrides import TorchFunctionMode

    engine = _use(llm, True)
    held: list[torch.Tensor] = []  # kept alive, so no storage of a marked tensor is reused
    marked: set[int] = set()
    current: list[torch.Tensor] = []
    late_reads: list[str] = []

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if (
                name in HOST_READS
                and args
                and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage().data_ptr() in marked
            ):
                late_reads.append(name)
            return func(*args, **(kwargs or {}))

    execute = engine.worker.execute

    def recording(plan, rows, previous=None):
        marked.update(t.untyped_storage().data_ptr() for t in current if t.numel())
        current.clear()
        out = execute(plan, rows, previous)
        s = out.sampled
        tensors = [out.last_token_ids, out.expert_counts] + (
            [] if s is None else [s.token_ids, s.logprobs, s.top_token_ids, s.top_logprobs, s.errors]
        )
        current.extend(t for t in tensors if t is not None)
        held.extend(current)
        return out

    engine.worker.execute = recording
    try:
        with Reads():
            out = _run(
                engine,
                [
                    ("r1", _prompt(1, 12), SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2)),
                    ("r2", _prompt(2, 30), SamplingParams(max_tokens=6, ignore_eos=True, seed=3)),
                ],
                {},
            )
    finally:
        del engine.worker.execute
        _use(llm, False)
    assert len(out["r1"][0]) == 8 and len(out["r1"][2]) == 8 and len(marked) >= 6 * 3
    assert late_reads == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_async_decode_steps_never_synchronise_the_stream():
    """The GPU form of the test above: CUDA's sync debug mode raises on every operation that waits for the
    stream (``tolist``/``item``/``cpu`` of a device tensor, a pageable upload, a stream synchronise). With
    async scheduling and decode graphs no decode step may do one: step N is read through its host copy's
    event, which waits for N alone. Prefill steps (eager, drained) run before the mode is set."""
    llm = LLM(model="tiny", device="cuda", block_size=16, max_num_seqs=8)  # CUDA defaults: fp8, graphs, async
    engine = llm.engine
    assert engine.config.async_scheduling and engine.config.cuda_graphs
    prompts = [_prompt(i, 20) for i in range(8)]
    params = [
        SamplingParams(max_tokens=12, ignore_eos=True, seed=i, temperature=0.8, logprobs=2 if i % 2 else None)
        for i in range(8)
    ]
    first = llm.generate(prompts, params)  # every kernel compiled and tuned before the mode is set
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"g{i}", prompt, p)
    # Every request prefilled and decoding: the scheduler may put a prefill step between decode steps while
    # prompts still wait, and prefill steps run eager (and read the device).
    for _ in range(len(prompts) + 2):
        plan = engine.last_plan
        if (
            plan is not None
            and not plan.is_prefill
            and plan.graph_size is not None
            and plan.num_requests == len(prompts)
        ):
            break
        engine.step()
    else:
        pytest.fail(f"no graph decode step of every request after the prefills: {engine.last_plan}")
    done = {}
    graphs = engine.worker.runner  # a DecodeStepGraphs: counts the steps that ran eagerly
    num_eager = graphs.num_eager
    torch.cuda.set_sync_debug_mode("error")
    try:
        while engine.has_unfinished():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    except RuntimeError as err:  # name the step, so a failure says which path synchronised
        raise AssertionError(
            f"a step synchronised; the last plan {engine.last_plan}, "
            f"{graphs.num_eager - num_eager} eager steps since the mode was set"
        ) from err
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [(done[f"g{i}"].token_ids, done[f"g{i}"].logprobs) for i in range(8)] == [
        (o.token_ids, o.logprobs) for o in first
    ]  # the same seeds give the same tokens
    s = engine.stats()
    assert s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots
