"""services/bench/kernels_prefill_moe.py at toy sizes on CPU: the grouped GEMM interpreted, cuBLASLt's
block-scaled GEMM emulated in fp32 (tests/services/worker/test_kernel_moe.py's emulation), every timer one
call. Both rows must compute the same layer, or the comparison would be between different work."""

from __future__ import annotations

import sys

import torch

from services.bench import kernel_timing as timing
from services.bench import kernels_prefill_moe as prefill_moe
from services.worker import block_scaled_gemm
from tests.kernels.interpret import interpreter, load_interpreted
from tests.services.worker.test_kernel_moe import _emulated_matmul
from tests.tolerances import BF16_TRUNC_REL


def test_both_rows_at_toy_sizes_compute_the_same_layer(monkeypatch):
    for name in ("moe_grouped_gemm", "quant_fp8", "moe_combine"):
        monkeypatch.setitem(sys.modules, f"kernels.{name}", load_interpreted(name))
    monkeypatch.setattr(block_scaled_gemm, "available", lambda device, out_dtype=torch.bfloat16: True)
    monkeypatch.setattr(block_scaled_gemm, "matmul", _emulated_matmul)
    outputs: list[torch.Tensor] = []

    def one_call(fn):
        outputs.append(fn())
        return 1e-3

    monkeypatch.setattr(prefill_moe, "_bench", one_call)
    monkeypatch.setattr(timing, "DEVICE", "cpu")  # the shared weight maker's
    for name, value in (("DEVICE", "cpu"), ("HIDDEN", 256), ("INTER", 128), ("EXPERTS", 16), ("TOP_K", 2)):
        monkeypatch.setattr(prefill_moe, name, value)
    import services.bench.kernels_decode_gemms as decode_gemms
    monkeypatch.setattr(decode_gemms, "DEVICE", "cpu")
    monkeypatch.setattr(decode_gemms, "EXPERTS", 16)
    monkeypatch.setattr(decode_gemms, "TOP_K", 2)
    ceil = {"bandwidth": 4e12, "fp8_peak": 1e15, "bf16_peak": 5e14}
    with interpreter():
        rows = prefill_moe.bench_layer(40, ceil, torch.Generator().manual_seed(0))
    # 40 tokens are below MIN_TOKENS: the engine stays on Triton, and the cuBLASLt row is still measured.
    assert [r["kernel"] for r in rows] == ["prefill moe layer [grouped Triton] (engine)",
                                           "prefill moe layer [cuBLASLt per expert]"]
    assert all(r["us"] == 1000.0 and r["tflop_s"] > 0 for r in rows)
    triton, cublas = outputs
    assert triton.shape == cublas.shape == (40, 256)
    # The bound of test_kernel_moe's comparison of the two paths (the interpreter truncates bf16).
    assert float((cublas - triton).norm() / triton.norm()) <= BF16_TRUNC_REL
