"""services/bench/kernels/prefill_moe.py at toy sizes on CPU: the grouped GEMM interpreted, cuBLASLt's
block-scaled GEMM emulated in fp32 (tests/services/worker/kernel_model/test_moe.py's emulation), every timer one
call. Both rows must compute the same layer, or the comparison would be between different work."""

from __future__ import annotations

import sys

import torch

from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.moe import clamped_swiglu
from services.bench import harness as timing
from services.bench.kernels import decode_gemms, prefill_moe
from services.worker.kernel_model import block_scaled_experts, block_scaled_gemm
from tests.services.worker.kernel_model.test_moe import _emulated_matmul
from tests.tolerances import BF16_TRUNC_REL, FP8_LINEAR_REL


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
    monkeypatch.setattr(decode_gemms, "DEVICE", "cpu")
    monkeypatch.setattr(decode_gemms, "EXPERTS", 16)
    monkeypatch.setattr(decode_gemms, "TOP_K", 2)
    ceil = {"bandwidth": 4e12, "fp8_peak": 1e15, "bf16_peak": 5e14}
    with interpreter():
        rows = prefill_moe.bench_layer(40, ceil, torch.Generator().manual_seed(0))
    # 40 tokens are below MIN_TOKENS: the engine stays on Triton, and the cuBLASLt row is still measured.
    assert [r["kernel"] for r in rows] == [
        "prefill moe layer [grouped Triton] (engine)",
        "prefill moe layer [cuBLASLt per expert]",
        "prefill moe gate/up [grouped Triton]",
        "prefill moe gate/up [cuBLASLt per expert]",
        "prefill moe down [grouped Triton]",
        "prefill moe down [cuBLASLt per expert]",
    ]
    assert all(r["us"] == 1000.0 and r["tflop_s"] > 0 for r in rows)
    triton, cublas = outputs[:2]
    # Each product's two rows compute it on the same rows: gate/up's Triton h (SwiGLU epilogue, e4m3) against
    # SwiGLU · routing weight of the emulated products, within one e4m3 cast (FP8_LINEAR_REL covers two); down's
    # bf16 outputs within the layer's bound, slot by slot.
    meta = decode_gemms.layer_meta(40, torch.Generator().manual_seed(0))  # the bench's draws
    flat, starts, spans = block_scaled_experts.compact_rows(meta["counts"], 40)
    (h_q, h_s), gate_up = outputs[2], torch.cat(outputs[3])
    want = clamped_swiglu(gate_up[:, :128], gate_up[:, 128:], 10.0) * meta["route_w"].reshape(-1)[flat][:, None]
    got = (h_q.float() * h_s.repeat_interleave(128, -1)).reshape(-1, 128)[flat]
    assert float((got - want).norm() / want.norm()) <= FP8_LINEAR_REL
    y_triton, y_cublas = outputs[4].reshape(-1, 256)[flat], torch.cat(outputs[5])
    assert float((y_cublas.float() - y_triton.float()).norm() / y_triton.float().norm()) <= BF16_TRUNC_REL
    assert triton.shape == cublas.shape == (40, 256)
    # The bound of test_kernel_moe's comparison of the two paths (the interpreter truncates bf16).
    assert float((cublas - triton).norm() / triton.norm()) <= BF16_TRUNC_REL
