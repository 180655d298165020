"""`shinkai bench prefix` on the tiny model, small: both workloads run with the cache on and off, and the cache
computes fewer prefill tokens for the same prompts (the figures are the GPU run's; this checks the harness)."""

import json

from services.entrypoints.cli import build_parser


def test_the_prefix_bench_runs_both_workloads_on_and_off(tmp_path):
    out = tmp_path / "prefix.json"
    args = build_parser().parse_args(
        [
            "bench", "prefix", "--conversations", "2", "--turns", "3", "--user-tokens", "40", "--answer-tokens", "4",
            "--shared-tokens", "300", "--suffix-tokens", "20", "--requests", "6", "--wave", "2", "--json", str(out),
        ]
    )  # fmt: skip
    assert args.func(args) == 0
    figures = json.loads(out.read_text())
    for workload, rounds in (("multi_turn", "turns"), ("agent", "waves")):
        off, on = figures["off"][workload], figures["on"][workload]
        assert len(on[rounds]) == 3 and on["prompt_tokens"] == off["prompt_tokens"]
        assert off["prefill_tokens_computed"] == off["prompt_tokens"]
        assert on["prefill_tokens_computed"] < off["prefill_tokens_computed"]
        assert all(r["ttft_p99_s"] >= r["ttft_p50_s"] > 0 for r in on[rounds])


def test_the_cache_off_run_is_on_disk_before_the_cache_on_run_starts(tmp_path, monkeypatch):
    """A GPU suite cuts the bench at its time limit: the run that finished is in the JSON already."""
    import pytest

    import services.engine

    real = services.engine.LLM

    def cache_on_fails(*args, **kwargs):
        if kwargs.get("enable_prefix_caching"):
            raise RuntimeError("cut here")
        return real(*args, **kwargs)

    monkeypatch.setattr(services.engine, "LLM", cache_on_fails)
    out = tmp_path / "prefix.json"
    args = build_parser().parse_args(
        [
            "bench", "prefix", "--workload", "agent", "--shared-tokens", "40", "--suffix-tokens", "8",
            "--answer-tokens", "2", "--requests", "2", "--wave", "2", "--json", str(out),
        ]
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="cut here"):
        args.func(args)
    figures = json.loads(out.read_text())
    assert set(figures) == {"args", "off"} and len(figures["off"]["agent"]["waves"]) == 1
