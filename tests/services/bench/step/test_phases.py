"""services/bench/step/phases.py: host ms per decode step by phase, around a live (host-only) engine."""

import pytest

from services.bench.step.host_step import HostOnlyRunner, HostOnlySampler
from services.bench.step.phases import PHASES, StepPhases
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.worker.worker import Worker


def _engine(async_scheduling: bool) -> Engine:
    config = EngineConfig(max_num_seqs=3, max_model_len=300, block_size=128, async_scheduling=async_scheduling)
    engine = Engine(
        Worker(HostOnlyRunner(2, 4), HostOnlySampler()),
        config,
        vocab_size=100,
        eos_token_id=1,
        compress_ratios=[4, 1],
        window_size=128,
    )
    for i in range(3):
        engine.add_request(f"r{i}", [5] * 200, SamplingParams(max_tokens=5, ignore_eos=True))
    return engine


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_every_decode_step_is_split_and_the_engine_is_restored(async_scheduling):
    engine = _engine(async_scheduling)
    scheduler, runner, sampler = engine.scheduler, engine.worker.runner, engine.worker.sampler
    phases = StepPhases()
    phases.attach(engine)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    phases.detach()
    assert sorted(o.token_ids for o in outputs) == [[7] * 5] * 3  # the wrapped engine still generates
    # 5 tokens: the prefill step samples the first, 4 decode steps the rest (each a timed sample); with async
    # a 5th decode step is planned before the 4th is updated (its rows are dropped at its update).
    assert len(phases.samples) == (4 if not async_scheduling else 5)
    for sample in phases.samples:
        assert all(sample[p] >= 0 for p in PHASES if p != "other")
        assert sample["total"] == pytest.approx(sum(sample[p] for p in PHASES))
        assert sample["launch"] > 0 and sample["schedule"] > 0
    # Reads happen in decode calls: every one in a synchronous engine; with async, all but the first, which
    # queues its step behind the drained prefill and reads nothing yet.
    reads = [s["read"] > 0 for s in phases.samples]
    assert reads == ([True] * 4 if not async_scheduling else [False, True, True, True, True])
    summary = phases.summary()
    assert set(summary) == {*PHASES, "total"}
    assert engine.scheduler is scheduler and engine.worker.runner is runner and engine.worker.sampler is sampler
    assert "step" not in vars(engine) and "execute" not in vars(engine.worker)
