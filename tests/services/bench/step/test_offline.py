"""services/bench/step/offline.py: the decode steps' busy fraction from a device timeline."""

import pytest

from services.bench.step.offline import decode_window_busy


def test_decode_busy_counts_the_window_after_the_last_prefill_and_overlaps_once():
    kernels = [
        (0, 50, "_prefill_attention_kernel"),
        (60, 100, "_prefill_attention_kernel"),  # the window opens at 100
        (90, 110, "_moe_gemm_kernel"),  # 10 of it inside the window
        (120, 150, "_moe_gemm_kernel"),
        (130, 160, "_splitk_kernel"),  # overlaps the previous one on another stream: 120..160 once
        (180, 200, "_sampler_kernel"),
    ]
    # busy 10 + 40 + 20 = 70 over the window 100..200
    assert decode_window_busy(kernels) == pytest.approx(0.7, abs=0, rel=1e-12)


def test_without_prefill_the_window_is_the_whole_timeline_and_empty_is_none():
    assert decode_window_busy([(10, 20, "a"), (30, 50, "b")]) == pytest.approx(30 / 40, abs=0, rel=1e-12)
    assert decode_window_busy([(0, 10, "_prefill_attention_kernel")]) is None
    assert decode_window_busy([]) is None


def test_the_offline_rows_run_alone_with_host_ms_by_phase(tmp_path):
    import json

    from services.bench.step.offline import main
    from services.bench.step.phases import PHASES

    out = tmp_path / "offline.json"
    assert main(["--batch", "2", "--steps", "3", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["async"] for r in rows] == [False, True]
    for r in rows:
        assert r["tokens"] == 2 * 3
        assert set(r["host_ms"]) == {*PHASES, "total"} and r["host_ms"]["launch"] > 0
