"""The host-share benchmark: a real engine and scheduler with the device work stubbed."""

from services.bench.step.host_step import HostOnlyRunner, HostOnlySampler, host_section, host_step_ms
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.worker.worker import Worker


def test_host_step_reaches_full_decode_steps_and_times_them():
    assert host_step_ms(4, context=300, steps=3) > 0
    rows = host_section((1, 3), 200)
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 200), (3, 200)]
    assert all(r["sync_ms"] > 0 and r["async_ms"] > 0 for r in rows)


def test_the_stubbed_engine_generates_and_returns_every_block():
    config = EngineConfig(max_num_seqs=3, max_model_len=300, block_size=128, async_scheduling=True)
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
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.finished]
    assert sorted(o.request_id for o in outputs) == ["r0", "r1", "r2"]
    assert all(o.token_ids == [7] * 5 for o in outputs)
    s = engine.stats()
    assert s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots
