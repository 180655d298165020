"""`bench step --dp 1 --ep-path --profile`'s report: two decode profiles side by side and the kernels the
expert-parallel path adds (the timed run itself needs a GPU)."""

from types import SimpleNamespace

from services.bench.step.ep_path import CONTEXT, profile_report
from services.bench.step.profile import kernel_table, launch_totals


def _profile(events, num_steps=2):
    events = [SimpleNamespace(name=n, device_time=us, device_type=SimpleNamespace(name="CUDA")) for n, us in events]
    return {
        "batch": 64,
        "context": CONTEXT,
        "wall_ms": 1.0,
        "busy_ms": 0.5,
        **launch_totals(events, num_steps),
        "kernels": kernel_table(events, num_steps, top=None),
    }


def test_the_report_prints_both_tables_and_the_added_kernels(capsys):
    without = _profile([("gemm", 10.0), ("gemm", 10.0), ("router", 2.0), ("router", 2.0)])
    with_ep = _profile(
        [("gemm", 11.0), ("gemm", 11.0), ("router", 2.0), ("router", 2.0)]
        + [("sort", 1.5)] * 4
        + [("nccl all_to_all", 6.0)] * 2
    )
    row = profile_report(64, without, with_ep)
    assert row["section"] == "profile" and row["batch"] == 64 and row["without"] is without and row["with"] is with_ep
    assert [(r["kernel"], r["extra_launches"]) for r in row["diff"]] == [
        ("nccl all_to_all", 1.0),
        ("sort", 2.0),
        ("gemm", 0.0),
        ("router", 0.0),
    ]
    out = capsys.readouterr().out
    assert "batch 64 without" in out and "batch 64 with the EP path" in out
    assert "launches +3 kernels per step, +0.010 ms in kernels" in out
    added, same = out.split("kernels whose launches differ:")[1].split("at equal launches:")
    assert "×   0.0 → ×   2.0  sort" in added and "gemm" not in added
    assert "+1.0 µs  ×   1.0 → ×   1.0  gemm" in same  # the same launches, slower
