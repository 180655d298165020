"""The staged-window comparison of the prefill attention bench (services/bench/kernels/prefill_attention.py)
at toy sizes on the CPU: interpreted kernels, each timer one call at a stand-in 100 µs."""

from __future__ import annotations

import sys

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from services.bench import harness as timing
from services.bench.kernels import prefill_attention as bench
from tests.kernels.bf16_emulation import bf16_interpreter


def test_window_staging_rows_and_layer_sums(monkeypatch, capsys):
    def one_call(fn):
        fn()
        return 1e-4

    monkeypatch.setitem(sys.modules, "kernels.prefill_attention", load_interpreted("prefill_attention"))
    monkeypatch.setattr(timing, "_bench_replay", one_call)
    # An 8-row chunk at the end of a 300-token context: its windows reach into the ring.
    with interpreter(), bf16_interpreter():
        results = bench.window_staging(
            torch.Generator().manual_seed(0), ((8, 300),), device="cpu", num_heads=4, head_dim=64
        )
    assert [r["layer"] for r in results] == ["compressed (staged entries)", "window only"]
    assert all(r["equal"] and r["in_loop_us"] == r["staged_total_us"] == pytest.approx(100.0) for r in results)
    bench.print_window_staging(results, 40, 2)
    out = capsys.readouterr().out
    assert "compressed (staged entries)" in out and "window only" in out
    assert "chunk 8 ctx 300: 40 layers (2 window-only) in-loop 4.00 ms, staged window 4.00 ms" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_without_cuda_it_says_so_and_exits_non_zero(capsys):
    assert bench.main() != 0
    assert "no CUDA device" in capsys.readouterr().err
