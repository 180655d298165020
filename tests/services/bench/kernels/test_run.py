"""`shinkai bench kernels` on a machine without CUDA, and its bookkeeping at toy sizes.

The timing itself needs an H200 (docs/performance.md); here the kernels run under Triton's
interpreter on CPU tensors and every timer is replaced by one call, so the table and the JSON are
built from the same code paths with made-up times."""

from __future__ import annotations

import argparse
import json
import sys

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from services.bench import harness as timing
from services.bench.kernels import decode_attention as kernels_decode_attention
from services.bench.kernels import run as bench


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_without_cuda_it_says_so_and_exits_non_zero(capsys):
    assert bench.main(argparse.Namespace(quick=True, sweep=False, json_path=None)) == bench.NOTHING_MEASURED != 0
    assert "no CUDA device" in capsys.readouterr().err


def test_table_and_json_at_toy_sizes(monkeypatch, tmp_path, capsys):
    for name in ("moe_grouped_gemm", "moe_router", "rmsnorm", "quant_fp8", "decode_attention"):
        monkeypatch.setitem(sys.modules, f"kernels.{name}", load_interpreted(name))

    def one_call(fn):
        fn()
        return 1e-4

    for timer in ("_bench", "_bench_graph", "_bench_replay"):
        monkeypatch.setattr(timing, timer, one_call)
    monkeypatch.setattr(timing, "measure_bandwidth", lambda: 4e12)
    monkeypatch.setattr(timing, "measure_fp8_peak", lambda: 1e15)
    monkeypatch.setattr(timing, "measure_bf16_peak", lambda: 5e14)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args: "toy")
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *args, **kwargs: None, raising=False)
    monkeypatch.setattr(timing, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "HIDDEN", 256)
    monkeypatch.setattr(bench, "INTER", 128)
    monkeypatch.setattr(bench, "EXPERTS", 8)
    monkeypatch.setattr(bench, "NORM_TOKENS", (3,))
    monkeypatch.setattr(bench, "DECODE_TOKENS", (2,))
    monkeypatch.setattr(bench, "SWEEP_TOKENS", (2,))
    monkeypatch.setattr(bench, "SWEEP", bench.SWEEP[:1])
    # Decode attention keeps the Flash head shapes (64 × 512): two rows at a 256-token context.
    monkeypatch.setattr(kernels_decode_attention, "ATTN_CONTEXTS", (256,))
    monkeypatch.setattr(kernels_decode_attention, "ATTN_SWEEP_ROWS", ())
    monkeypatch.setattr(bench, "EXTRA", ())  # the other kernels' bench modules have their own CPU tests
    out = tmp_path / "k.json"
    with interpreter():
        assert bench.main(argparse.Namespace(quick=False, sweep=True, json_path=str(out))) == 0
    result = json.loads(out.read_text())
    kinds = [row["kernel"] for row in result["rows"]]
    assert kinds.count("rmsnorm") == 1 and kinds.count("moe router") == 2
    assert {"moe gate/up+swiglu fp8→fp8", "moe down fp8→bf16", "moe down bf16→bf16"} <= set(kinds)
    assert any(kind.endswith("[best of sweep]") for kind in kinds)
    attn = next(row for row in result["rows"] if row["kernel"] == "sparse decode attention")
    # 2 rows: q and out (2 · 64 · 512 · 2 B), 128 window rows of 528 B, 128 selected entries (only
    # 128 are visible at 256 tokens) of 288 B + 4 B of slot, 16 B of position and state slot.
    assert attn["us"] == pytest.approx(100.0)
    assert attn["tb_s"] * 1e12 * 1e-4 == pytest.approx(2 * (2 * 64 * 512 * 2 + 128 * 528 + 128 * 292 + 16))
    assert attn["mem_roofline_us"] > 0 and attn["compute_roofline_us"] > 0
    down = next(row for row in result["rows"] if row["kernel"] == "moe down fp8→bf16")
    # 100 µs for the toy sizes: bytes / time, the roofline from the stand-in ceilings.
    assert down["us"] == pytest.approx(100.0) and down["tb_s"] > 0 and down["speedup_vs_torch"] == pytest.approx(1.0)
    assert "moe gate/up+swiglu fp8→fp8" in capsys.readouterr().out
