"""The scheduler benchmark runs end to end (its figures are reported, never asserted)."""

import json

from services.bench.scheduler import kitchen_table
from services.entrypoints.cli import main


def test_kitchen_table_matches_the_walkthrough():
    lines = kitchen_table()
    assert lines[0].split()[:5] == ["step", "1", "prefill", "A[0..5]", "B[0..1]"]
    assert lines[1].split()[:5] == ["step", "2", "prefill", "B[2..4]", "C[0..3]"]
    assert 'A gets "slept"' in lines[2]
    assert "A gets the end token and leaves" in lines[4]
    assert lines[5].split()[2:5] == ["decode", "B", "C"]


def test_bench_scheduler_cli_writes_json(tmp_path, capsys):
    out = tmp_path / "figures.json"
    assert main(["bench", "scheduler", "--num-requests", "8", "--steps", "20", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert figures["rows_per_step"] == 8 * 6
    assert figures["schedule_plus_update"]["p50_us"] > 0
    assert main(["bench", "scheduler", "--num-requests", "8", "--steps", "20", "--baseline", str(out)]) == 0
    assert "against the baseline" in capsys.readouterr().out
