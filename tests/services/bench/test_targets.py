"""Benchmark summaries name every figure past its target, not only the p50's ratio."""

import json

import services.bench.scheduler as scheduler_bench
from services.bench.targets import Target, past, verdict_lines
from services.entrypoints.cli import main


def test_a_p99_past_the_target_is_flagged_while_the_p50_meets_it():
    targets = [Target("p50 step (us)", 132.0, 200.0), Target("p99 step (us)", 4400.0, 200.0)]
    lines = verdict_lines(targets)
    assert lines[0].endswith(": met") and "0.66×" in lines[0]
    assert lines[1].endswith("PAST THE TARGET") and "22.00×" in lines[1]
    assert lines[-1] == "PAST THE TARGET: p99 step (us)"
    assert past(targets) == ["p99 step (us)"]


def test_a_figure_that_must_reach_its_target():
    assert past([Target("top-1 agreement", 0.98, 0.99, at_most=False)]) == ["top-1 agreement"]
    assert verdict_lines([Target("top-1 agreement", 0.995, 0.99, at_most=False)])[-1] == "every target met"


def test_bench_scheduler_names_the_figures_past_its_target(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(scheduler_bench, "TARGET_US", 1e-3)  # every real step is past a nanosecond
    out = tmp_path / "figures.json"
    assert main(["bench", "scheduler", "--num-requests", "8", "--steps", "20", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "PAST THE TARGET: mean schedule+update (us), p50 schedule+update (us), p99 schedule+update (us)" in printed
    assert json.loads(out.read_text())["past_target"] == [
        "mean schedule+update (us)",
        "p50 schedule+update (us)",
        "p99 schedule+update (us)",
    ]
