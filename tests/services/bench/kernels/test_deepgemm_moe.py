"""services/bench/kernels/deepgemm_moe.py at toy sizes on CPU: the Triton kernels interpreted, ``deep_gemm`` and
cuBLASLt's block-scaled GEMM replaced by torch stand-ins, every timer one call. The rows must come out in the
documented order with their accuracy checks passing: the one GPU call that runs this bench cannot be repeated
to fix a typo."""

from __future__ import annotations

import sys

import torch

import kernels
from kernels import deepgemm_moe
from kernels.interpret import interpreter, load_interpreted
from services.bench import harness as timing
from services.bench.kernels import decode_gemms, prefill_moe
from services.bench.kernels import deepgemm_moe as deep_bench
from services.worker.kernel_model import block_scaled_gemm
from tests.kernels.test_deepgemm_moe import fake_deep_gemm
from tests.services.worker.kernel_model.test_moe import _emulated_matmul


def test_every_row_at_toy_sizes_with_its_checks_passing(monkeypatch):
    for name in ("moe_grouped_gemm", "quant_fp8", "moe_combine", "moe_contiguous"):
        module = load_interpreted(name)
        monkeypatch.setitem(sys.modules, f"kernels.{name}", module)
        # `from kernels import X` reads the package's attribute, set by any earlier import of the compiled module.
        monkeypatch.setattr(kernels, name, module, raising=False)
    monkeypatch.setattr(deepgemm_moe, "module", lambda: fake_deep_gemm(8))
    monkeypatch.setattr(deepgemm_moe, "available", lambda device: True)
    monkeypatch.setattr(block_scaled_gemm, "available", lambda device, out_dtype=torch.bfloat16: True)
    monkeypatch.setattr(block_scaled_gemm, "matmul", _emulated_matmul)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    for module in (deep_bench, prefill_moe):
        monkeypatch.setattr(module, "_bench", lambda fn: fn() is not None and 1e-3)
    monkeypatch.setattr(deep_bench, "_bench_replay", lambda fn: fn() is not None and 1e-3)
    monkeypatch.setattr(timing, "DEVICE", "cpu")  # the shared weight maker's
    for module in (deep_bench, prefill_moe):
        for name, value in (("DEVICE", "cpu"), ("HIDDEN", 256), ("INTER", 128), ("EXPERTS", 16), ("TOP_K", 2)):
            monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(decode_gemms, "DEVICE", "cpu")
    monkeypatch.setattr(decode_gemms, "EXPERTS", 16)
    monkeypatch.setattr(decode_gemms, "TOP_K", 2)
    monkeypatch.setattr(deep_bench, "CASES", (("prefill", 40), ("decode", 16)))
    ceil = {"bandwidth": 4e12, "fp8_peak": 1e15, "bf16_peak": 5e14}
    with interpreter():
        rows = deep_bench.bench(ceil, False, torch.Generator().manual_seed(0))
    assert [r["kernel"] for r in rows] == [
        "prefill moe layer [DeepGEMM contiguous]",
        "prefill moe layer [DeepGEMM contiguous, torch layout]",
        "prefill moe layer [grouped Triton]",
        "prefill moe layout [Triton, quantise then gather]",
        "prefill moe layout [Triton, quantise per row]",
        "prefill moe layout [torch]",
        "prefill moe layer [cuBLASLt per expert]",
        "prefill moe gate/up [DeepGEMM contiguous]",
        "prefill moe down [DeepGEMM contiguous]",
        "prefill moe gate/up [grouped Triton]",
        "prefill moe gate/up [cuBLASLt per expert]",
        "prefill moe down [grouped Triton]",
        "prefill moe down [cuBLASLt per expert]",
        "decode moe layer [DeepGEMM masked]",
        "decode moe layer [grouped Triton] (engine)",
        "decode moe gate/up [DeepGEMM masked]",
        "decode moe gate/up [grouped Triton] (engine)",
        "decode moe down [DeepGEMM masked]",
        "decode moe down [grouped Triton] (engine)",
    ]
    notes = " ".join(r["note"] for r in rows)
    assert "FAIL" not in notes and notes.count("(ok ≤") == 6  # two layers, four products
    assert notes.count("byte-equal (ok)") == 2 and notes.count("the default;") == 1  # the layout kernel both ways
    assert "glue (layer less both products) -1000 us" in notes  # every timer 1 ms: one layer less two products
    assert all(r["us"] == 1000.0 and (r["tflop_s"] > 0 or " layout [" in r["kernel"]) for r in rows)
