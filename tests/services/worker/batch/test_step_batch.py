"""StepBatch from a real plan: the host facts it carries equal what the device tensors would give."""

import pytest
import torch

from scheduler_rs import PreemptionMode, Scheduler, SchedulerConfig, StepResult
from services.worker.batch.step_batch import StepBatch, check_ring_slots


def _scheduler() -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            block_size=16,
            num_blocks=64,
            num_state_slots=8,
            max_num_seqs=4,
            max_num_batched_tokens=48,
            max_model_len=200,
            window_size=8,
            compress_ratios=[4, 1],
            preemption_mode=PreemptionMode.STOP,
            vocab_size=100,
        )
    )


def test_host_facts_match_the_device_tensors_for_prefill_and_decode_plans():
    sched = _scheduler()
    for i, n in enumerate((30, 7, 45)):
        sched.add_request(f"r{i}", [5] * n, max_tokens=4, eos_token_id=1, ignore_eos=True, stop_token_ids=[])
    kinds = set()
    while sched.has_unfinished():
        plan = sched.schedule()
        batch = StepBatch.from_plan(plan)
        rows_per_request = batch.query_start[1:] - batch.query_start[:-1]
        assert batch.decode_only == bool((rows_per_request == 1).all())
        if batch.num_requests:
            for ratio in (1, 4, 128):
                assert batch.max_entries(ratio) == int((batch.seqlens_k // ratio).max())
        check_ring_slots(plan, sched.config.ring_size)
        kinds.add(batch.decode_only)
        counts = list(plan.num_sample_rows.tolist())
        sched.update(plan, StepResult(counts, [7] * sum(counts)))
    assert kinds == {True, False}


def test_check_ring_slots_names_a_mismatch():
    sched = _scheduler()
    sched.add_request("r", [5] * 20, max_tokens=2, eos_token_id=1, ignore_eos=True, stop_token_ids=[])
    plan = sched.schedule()
    with pytest.raises(ValueError, match="not position mod 7"):
        check_ring_slots(plan, 7)
    assert torch.is_tensor(StepBatch.from_plan(plan).positions)
