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
