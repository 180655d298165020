"""ExpertLoadPublisher under both engine modes: a synchronous engine's step is published at once; an async
engine's (which passes the step in flight) is published after the next step is queued, and the wrapped
worker gets the step in flight."""

import asyncio

import numpy as np
import torch

from services.engine.reporting import expert_loads
from services.engine.reporting.expert_loads import ExpertLoadPublisher
from services.eplb.messages import decode_load


class FakeWorker:
    in_process, num_losses = True, 0

    def __init__(self):
        self.calls = []

    def execute(self, plan, rows, *previous):
        return self.sample(self.launch(plan, rows, *previous))

    def launch(self, plan, rows, *previous):
        self.calls.append(previous)
        return len(self.calls)

    def sample(self, step, token_bitmask=None):
        return type("Out", (), {"expert_counts": torch.full((2, 3), step), "mask": token_bitmask})()


def _publisher(monkeypatch):
    sent = []

    def capture(published, loop):  # _publish below is a plain function: it has already recorded the report
        return None

    publisher = ExpertLoadPublisher(FakeWorker(), object(), asyncio.new_event_loop(), rank=1)
    monkeypatch.setattr(expert_loads.asyncio, "run_coroutine_threadsafe", capture)
    monkeypatch.setattr(publisher, "_publish", lambda data, headers=None: sent.append(decode_load(data)))
    return publisher, sent


def test_a_synchronous_engine_publishes_each_step_at_once(monkeypatch):
    publisher, sent = _publisher(monkeypatch)
    publisher.execute("plan", [])
    assert [r.step for r in sent] == [0] and np.all(sent[0].counts == 1)
    publisher.execute("plan", [])
    assert [r.step for r in sent] == [0, 1] and publisher.worker.calls == [(), ()]


def test_an_async_engine_step_is_published_after_the_next_is_queued(monkeypatch):
    publisher, sent = _publisher(monkeypatch)
    first = publisher.execute("plan", [], None)
    assert sent == [] and publisher.worker.calls == [(None,)]
    publisher.execute("plan", [], first)
    assert publisher.worker.calls[1] == (first,)
    assert [r.step for r in sent] == [0] and np.all(sent[0].counts == 1) and sent[0].rank == 1


def test_a_launched_step_is_sampled_with_its_mask_and_published_as_an_async_step(monkeypatch):
    """An async engine with structured output launches, then samples with the mask: both reach the wrapped worker,
    and the step's counts go out after the next step is queued."""
    publisher, sent = _publisher(monkeypatch)
    first = publisher.sample(publisher.launch("plan", [], None), token_bitmask="mask")
    assert first.mask == "mask" and publisher.worker.calls == [(None,)] and sent == []
    publisher.sample(publisher.launch("plan", [], first))
    assert publisher.worker.calls[1] == (first,)
    assert [r.step for r in sent] == [0] and np.all(sent[0].counts == 1)


def test_a_rank_publishes_its_own_report_of_each_step(monkeypatch):
    from services.eplb.messages import LoadReport

    publisher, sent = _publisher(monkeypatch)
    publisher.report = lambda step: LoadReport(
        rank=1, step=step, plan_version=3, counts=np.full((2, 4), 10 + step, dtype=np.int64)
    )
    publisher.execute("plan", [])
    publisher.execute("plan", [])
    assert [(r.step, r.plan_version) for r in sent] == [(0, 3), (1, 3)]
    assert np.all(sent[1].counts == 11)  # the report's slot counts, not the runner's logical ones


def test_an_async_step_counts_are_not_read_after_the_next_is_queued(monkeypatch):
    """On a GPU a host read of step N's device counts after step N+1 is queued waits for N+1: the publisher
    reads the host copy queued with step N instead (services/worker/host_copy.py)."""
    from torch.overrides import TorchFunctionMode

    publisher, sent = _publisher(monkeypatch)
    first = publisher.execute("plan", [], None)
    step_counts = first.expert_counts.untyped_storage().data_ptr()
    reads = []

    class Reads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if (
                getattr(func, "__name__", "") in ("cpu", "numpy", "tolist", "item")
                and args
                and isinstance(args[0], torch.Tensor)
                and args[0].untyped_storage().data_ptr() == step_counts
            ):
                reads.append(func.__name__)
            return func(*args, **(kwargs or {}))

    with Reads():
        publisher.execute("plan", [], first)
    assert [r.step for r in sent] == [0] and np.all(sent[0].counts == 1)
    assert reads == []


def test_the_publisher_passes_the_wrapped_workers_losses_through(monkeypatch):
    """The engine drops its prefix cache when its worker's loss count moves: a wrapped remote worker's must show."""
    publisher, _ = _publisher(monkeypatch)
    assert publisher.num_losses == 0
    publisher.worker.num_losses = 2
    assert publisher.num_losses == 2


def test_an_engine_behind_the_publisher_serves_what_its_in_process_worker_serves():
    """An engine process with NATS wraps its in-process worker in the publisher: penalties, prompt logprobs and
    async scheduling's step in flight still reach the worker, with the same tokens as without the wrapper."""
    from services.engine import LLM, SamplingParams

    llm = LLM("tiny", max_num_seqs=2, async_scheduling=True, batch_invariant=True)
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, presence_penalty=1.5, prompt_logprobs=1)
    prompt = list(range(5, 30))

    def run():
        out = llm.generate(prompt, params)[0]
        return out.token_ids, out.logprobs, out.prompt_logprobs

    plain = run()
    llm.engine.worker = ExpertLoadPublisher(llm.engine.worker, None, asyncio.new_event_loop(), rank=0)
    assert llm.engine.worker.in_process
    assert run() == plain
