"""The decode profiler: its kernel table from device events, and its run on CPU (no device events)."""

from types import SimpleNamespace

import pytest

from services.bench.step.profile import kernel_diff, kernel_table, launch_totals, profile_decode


def _event(name, us, device="CUDA"):
    return SimpleNamespace(name=name, device_time=us, device_type=SimpleNamespace(name=device))


def test_kernel_table_sums_per_step_and_sorts():
    events = [
        _event("gemm", 10.0),
        _event("gemm", 30.0),
        _event("attn", 50.0),
        _event("host", 99.0, "CPU"),
        _event("idle", 0.0),
    ]
    rows = kernel_table(events, num_steps=2, top=5)
    assert [r["kernel"] for r in rows] == ["attn", "gemm"]
    assert rows[0] == {"kernel": "attn", "us_per_step": 25.0, "launches_per_step": 0.5}
    assert rows[1]["us_per_step"] == 20.0 and rows[1]["launches_per_step"] == 1.0
    assert kernel_table(events, num_steps=1, top=1)[0]["kernel"] == "attn"


def test_launch_totals_count_every_kernel_and_keep_copies_apart():
    # 25 distinct kernels: more than the table's top 20, all counted.
    events = [_event(f"k{i}", 2.0) for i in range(25)] + [
        _event("k0", 4.0),
        _event("Memcpy HtoD (Pageable -> Device)", 3.0),
        _event("Memset (Device)", 1.0),
        _event("host", 99.0, "CPU"),
        _event("idle", 0.0),
    ]
    totals = launch_totals(events, num_steps=2)
    assert totals == pytest.approx(
        {"launches_per_step": 13.0, "kernel_ms": 0.027, "copies_per_step": 1.0, "copy_ms": 0.002}
    )


@pytest.fixture(scope="module")
def llm(one_torch_thread):
    from services.engine import LLM

    return LLM(model="tiny", max_num_seqs=2, max_model_len=128, block_size=16)


def test_profile_decode_on_cpu_runs_the_steps_and_returns_the_pools(llm):
    out = profile_decode(
        llm.engine,
        llm.engine.worker.runner.cache,
        batch=2,
        context=30,
        steps=2,
        vocab_size=llm.source.config.vocab_size,
    )
    assert out["batch"] == 2 and out["wall_ms"] > 0 and out["busy_ms"] == 0 and out["kernels"] == []
    assert out["launches_per_step"] == 0 and out["kernel_ms"] == 0
    assert llm.engine.last_plan.num_rows == 2 and not llm.engine.has_unfinished()
    s = llm.engine.stats()
    assert s.free_blocks == s.total_blocks and s.free_state_slots == s.total_state_slots


def test_profile_prefill_on_cpu_times_the_one_prefill_step():
    from services.bench.step.profile import profile_prefill
    from services.engine import LLM

    llm = LLM(
        model="tiny",
        max_num_seqs=1,
        max_model_len=64,
        block_size=16,
        max_num_batched_tokens=40,
        enable_prefix_caching=False,
    )  # a cold prompt step: no snapshot cut
    out = profile_prefill(
        llm.engine, llm.engine.worker.runner.cache.blocks.device, tokens=40, vocab_size=llm.source.config.vocab_size
    )
    assert out["tokens"] == 40 and out["wall_ms"] > 0 and out["kernels"] == []
    s = llm.engine.stats()
    assert s.free_blocks == s.total_blocks and not llm.engine.has_unfinished()


def test_kernel_diff_pairs_every_kernel_of_both_tables():
    without = kernel_table([_event("gemm", 10.0), _event("attn", 50.0), _event("gone", 4.0)], num_steps=1, top=None)
    with_ = kernel_table(
        [_event("gemm", 12.0), _event("attn", 20.0), _event("attn", 35.0), _event("sort", 3.0), _event("sort", 3.0)],
        num_steps=1,
        top=None,
    )
    rows = kernel_diff(without, with_)
    assert [r["kernel"] for r in rows] == ["sort", "attn", "gemm", "gone"]  # most added time first
    assert rows[0] == {
        "kernel": "sort",
        "launches_without": 0.0,
        "launches_with": 2.0,
        "us_without": 0.0,
        "us_with": 6.0,
        "extra_launches": 2.0,
        "extra_us": 6.0,
    }
    assert rows[1]["extra_launches"] == 1.0 and rows[1]["extra_us"] == 5.0
    assert rows[2]["extra_launches"] == 0.0 and rows[2]["extra_us"] == 2.0  # same launches, slower
    assert rows[3]["launches_with"] == 0.0 and rows[3]["extra_us"] == -4.0
    assert all(r["extra_launches"] == 0 and r["extra_us"] == 0 for r in kernel_diff(with_, with_))
