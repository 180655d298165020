"""The step-timing harness on CPU with the tiny model: real plans, skipped prefill, whole pools after."""

import pytest

from services.bench.step.timing import fit_line, skip_prefill, time_decode


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    from services.engine import LLM

    return LLM(model="tiny", max_num_seqs=4, max_model_len=256, block_size=16)


def _pools_whole(engine) -> bool:
    s = engine.stats()
    return s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots


def test_decode_steps_are_timed_at_the_asked_batch_and_the_pools_come_back(llm):
    cache = llm.engine.worker.runner.cache
    times = time_decode(llm.engine, cache, batch=3, context=40, steps=3, vocab_size=llm.source.config.vocab_size)
    assert len(times.seconds) == 3 and all(t > 0 for t in times.seconds)
    assert llm.engine.last_plan is not None and not llm.engine.has_unfinished()
    assert _pools_whole(llm.engine), llm.engine.stats()


def test_skip_prefill_reaches_decode_without_running_prompts(llm):
    from services.engine import SamplingParams

    calls = []
    runner = llm.engine.worker.runner
    original = runner.execute
    runner.execute = lambda plan, *a, **k: (calls.append(plan.is_prefill), original(plan, *a, **k))[1]
    try:
        llm.engine.add_request("a", list(range(3, 60)), SamplingParams(max_tokens=4, ignore_eos=True))
        skipped = skip_prefill(llm.engine)
    finally:
        runner.execute = original
    assert skipped >= 1 and calls == [False]  # only the first decode step ran
    llm.engine.abort("a")
    assert _pools_whole(llm.engine)


def test_decode_is_timed_when_the_prompts_need_mixed_steps(one_torch_thread):
    """A token budget below the batch's prompts: the scheduler mixes chunks with the decode rows of prompts
    already done, and those mixed plans are skipped too, never timed."""
    from services.engine import LLM

    llm = LLM(model="tiny", max_num_seqs=4, max_model_len=256, block_size=16, max_num_batched_tokens=64)
    cache = llm.engine.worker.runner.cache
    times = time_decode(llm.engine, cache, batch=4, context=40, steps=2, vocab_size=llm.source.config.vocab_size)
    assert len(times.seconds) == 2
    assert llm.engine.last_plan.kind == "decode" and llm.engine.last_plan.num_rows == 4
    assert _pools_whole(llm.engine), llm.engine.stats()


def test_fit_line_recovers_a_line():
    a, b = fit_line([1, 16, 64, 256], [0.004 + 0.00002 * r for r in (1, 16, 64, 256)])
    assert a == pytest.approx(0.004) and b == pytest.approx(0.00002)
