"""EngineConfig defaults that the scheduler's policies depend on."""

import pytest

from scheduler_rs import PreemptionMode, Scheduler, SchedulerConfig, StepResult
from services.engine.config import EngineConfig


@pytest.mark.parametrize(("num_seqs", "max_model_len", "block_size"), [(64, 4117, 128), (16, 200, 16), (1, 4117, 128)])
def test_default_blocks_admit_a_full_batch_of_full_length_prompts(num_seqs, max_model_len, block_size):
    """With the default pool, max_num_seqs prompts of max_model_len − 21 tokens (the step bench's
    4096 of 4117) all reach decode
    together: the scheduler admits a new prompt only while ≤ 90% of the blocks are held, so the pool
    needs that headroom (the step bench ran 60 of 64 without it)."""
    config = EngineConfig(max_num_seqs=num_seqs, max_model_len=max_model_len, block_size=block_size)
    sched = Scheduler(
        SchedulerConfig(
            block_size=block_size,
            num_blocks=config.resolved_num_blocks(),
            num_state_slots=config.resolved_num_state_slots(),
            max_num_seqs=num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=max_model_len,
            window_size=128,
            compress_ratios=[1],
            preemption_mode=PreemptionMode.STOP,
            vocab_size=1000,
        )
    )
    for i in range(num_seqs):
        sched.add_request(
            f"r{i}", [5] * (max_model_len - 21), max_tokens=8, eos_token_id=1, ignore_eos=True, stop_token_ids=[]
        )
    for _ in range(10 * num_seqs * max_model_len // config.max_num_batched_tokens + 10):
        plan = sched.schedule()
        if not plan.is_prefill:
            break
        counts = list(plan.num_sample_rows.tolist())
        sched.update(plan, StepResult(counts, [7] * sum(counts)))
    stats = sched.stats()
    assert (plan.num_rows, stats.num_running, stats.num_waiting) == (num_seqs, num_seqs, 0)
    per_request = -(-max_model_len // block_size)
    assert config.resolved_num_blocks() <= num_seqs * per_request * 10 // 9 + 2  # headroom, not a multiple


def test_the_scheduler_takes_every_size_from_engine_config():
    from services.engine import LLM

    llm = LLM("tiny", block_size=16, max_num_seqs=3, max_num_batched_tokens=48, max_model_len=96)
    got, config = llm.engine.scheduler.config, llm.config
    assert (
        got.block_size,
        got.num_blocks,
        got.num_state_slots,
        got.max_num_seqs,
        got.max_num_batched_tokens,
        got.max_model_len,
    ) == (16, config.resolved_num_blocks(), config.resolved_num_state_slots(), 3, 48, 96)


def test_the_worker_gets_the_same_resolved_sizes_as_the_scheduler():
    from services.worker.config import WorkerConfig

    config = EngineConfig(block_size=16, max_num_seqs=3, max_model_len=96, kernel_backend="fp8")
    assert config.worker_config() == WorkerConfig(
        block_size=16,
        num_blocks=config.resolved_num_blocks(),
        num_state_slots=4 + 12,  # the request slots, then prefix caching's 4 · max_num_seqs snapshots
        max_model_len=96,
        max_num_seqs=3,
        kernel_backend="fp8",
    )


def test_speculative_decoding_arguments_are_checked_and_shared_by_the_commands():
    import argparse

    from services.engine.config_flags import add_speculative_arguments, speculative_args

    with pytest.raises(ValueError, match="num_speculative_tokens must be >= 0"):
        EngineConfig(num_speculative_tokens=-1)
    with pytest.raises(ValueError, match="spec_sampling must be"):
        EngineConfig(spec_sampling="greedy")
    assert EngineConfig(num_speculative_tokens=2, kernel_backend="fp8", cuda_graphs=True).cuda_graphs
    with pytest.raises(ValueError, match="first_n_no_eos with speculative decoding needs async_scheduling off"):
        EngineConfig(num_speculative_tokens=2, async_scheduling=True, first_n_no_eos=1)
    assert EngineConfig(num_speculative_tokens=2, async_scheduling=True).async_scheduling
    p = argparse.ArgumentParser()
    add_speculative_arguments(p)
    assert speculative_args(p.parse_args([])) == {}
    args = p.parse_args(["--num-speculative-tokens", "3", "--spec-sampling", "deterministic"])
    assert speculative_args(args) == {
        "num_speculative_tokens": 3,
        "spec_sampling": "deterministic",
        "spec_varlen": False,
    }
    assert EngineConfig(**speculative_args(args)).num_speculative_tokens == 3
    varlen = speculative_args(p.parse_args(["--num-speculative-tokens", "3", "--spec-varlen"]))
    assert EngineConfig(**varlen).spec_varlen
    with pytest.raises(ValueError, match="spec_varlen needs num_speculative_tokens > 0"):
        EngineConfig(**speculative_args(p.parse_args(["--spec-varlen"])))
    with pytest.raises(ValueError, match="set spec_varlen=True"):
        EngineConfig(num_speculative_tokens=2, spec_step_cost_ms=((1, 1.0),))
    with pytest.raises(ValueError, match="spec_step_cost_ms needs"):
        EngineConfig(num_speculative_tokens=2, spec_varlen=True, spec_step_cost_ms=((1, 0.0),))


def test_step_flags_and_a_budget_that_cannot_hold_the_decode_rows():
    import argparse

    from services.engine.config_flags import add_step_arguments, step_args, step_argv

    assert EngineConfig().scheduling == "mixed"
    with pytest.raises(ValueError, match="scheduling must be 'mixed' or 'separate'"):
        EngineConfig(scheduling="chunked")
    # 32 requests × (1 + 3 drafts) = 128 decode rows: a mixed step holds them all, so the budget must too.
    with pytest.raises(ValueError, match=r"max_num_batched_tokens 100 .* = 128; raise --max-num-batched-tokens"):
        EngineConfig(max_num_seqs=32, num_speculative_tokens=3, max_num_batched_tokens=100)
    assert EngineConfig(max_num_seqs=32, num_speculative_tokens=3, max_num_batched_tokens=100, scheduling="separate")
    p = argparse.ArgumentParser()
    add_step_arguments(p)
    assert step_args(p.parse_args([])) == {}
    given = step_args(p.parse_args(["--max-num-batched-tokens", "512", "--scheduling", "separate"]))
    assert given == {"max_num_batched_tokens": 512, "scheduling": "separate"}
    assert step_args(p.parse_args(step_argv(given))) == given  # what `shinkai up` hands its engines
    assert EngineConfig(**given).max_num_batched_tokens == 512


def test_data_parallel_flags_and_what_ranks_do_not_run_yet():
    import argparse

    from services.engine.config_flags import add_parallel_arguments, parallel_args

    parser = argparse.ArgumentParser()
    add_parallel_arguments(parser)
    assert parallel_args(parser.parse_args([])) == {}
    assert parallel_args(parser.parse_args(["--dp", "4", "--num-redundant-experts", "2"])) == {
        "data_parallel_size": 4,
        "num_redundant_experts": 2,
    }
    assert parser.parse_args(["--data-parallel-size", "2"]).data_parallel_size == 2
    with pytest.raises(ValueError, match="data_parallel_size must be at least 1"):
        EngineConfig(data_parallel_size=0)
    # The kernel backend and graphs run with ranks (tests/services/engine/parallel/test_kernel_ranks.py), its FP8 form.
    EngineConfig(data_parallel_size=2, kernel_backend="fp8", cuda_graphs=True)
    with pytest.raises(ValueError, match="runs its FP8 form"):
        EngineConfig(data_parallel_size=2, kernel_backend="fp32")
    # Async scheduling and speculative decoding run with ranks (tests/services/engine/parallel/test_rank.py).
    EngineConfig(data_parallel_size=2, async_scheduling=True, num_speculative_tokens=2, spec_varlen=True)
    with pytest.raises(ValueError, match="rank_timeout_s"):
        EngineConfig(rank_timeout_s=0)


def test_max_model_len_defaults_to_what_the_model_and_the_pools_allow(caplog):
    import logging

    from services.engine import LLM
    from services.engine.config import default_max_model_len

    assert default_max_model_len(EngineConfig(num_blocks=9, block_size=4), 1 << 20) == 32  # the pools: 8 blocks
    assert default_max_model_len(EngineConfig(num_blocks=9, block_size=4), 20) == 20  # the model
    assert default_max_model_len(EngineConfig(), 1 << 20) == 4096  # pools sized from it
    with caplog.at_level(logging.INFO, logger="shinkai.engine"):
        llm = LLM(model="tiny", block_size=4, num_blocks=9, max_num_seqs=2)
    assert llm.config.max_model_len == 32 == llm.engine.scheduler.config.max_model_len
    assert "max_model_len 32: the model supports 1048576 positions" in caplog.text
    with pytest.raises(ValueError, match="longer than the model's"):
        LLM(model="tiny", max_model_len=(1 << 20) + 1)


def test_state_snapshots_follow_prefix_caching():
    assert EngineConfig(max_num_seqs=3).resolved_num_state_snapshots() == 12
    assert EngineConfig(max_num_seqs=3, num_state_snapshots=1).num_worker_state_slots() == 4 + 1
    off = EngineConfig(max_num_seqs=3, num_state_snapshots=5, enable_prefix_caching=False)
    assert off.resolved_num_state_snapshots() == 0 and off.num_worker_state_slots() == 4
    with pytest.raises(ValueError, match="num_state_snapshots"):
        EngineConfig(num_state_snapshots=-1)
