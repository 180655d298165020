"""services/bench/kernels/moe_splitk.py at toy sizes on CPU: the Triton kernels interpreted, every timer one call.
The rows must come out in the documented order with their accuracy checks passing and TB/s of the weight bytes
(the one GPU call that runs this bench cannot be repeated to fix a typo); the timed calls of each pair must
compute the same layer."""

from __future__ import annotations

import sys

import torch

from kernels.interpret import interpreter, load_interpreted
from services.bench import harness as timing
from services.bench.kernels import decode_gemms
from services.bench.kernels import moe_splitk as bench


def test_every_row_at_toy_sizes_with_its_checks_passing(monkeypatch):
    for name in ("moe_grouped_gemm", "quant_fp8", "moe_combine", "moe_splitk"):
        monkeypatch.setitem(sys.modules, f"kernels.{name}", load_interpreted(name))
    outputs: list[object] = []

    def one_call(fn):
        outputs.append(fn())
        return 1e-3

    monkeypatch.setattr(bench, "_bench_replay", one_call)
    monkeypatch.setattr(timing, "DEVICE", "cpu")  # the shared weight maker's
    for module in (bench, decode_gemms):
        for name, value in (("DEVICE", "cpu"), ("EXPERTS", 8), ("TOP_K", 2)):
            monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(bench, "HIDDEN", 256)
    monkeypatch.setattr(bench, "INTER", 128)
    monkeypatch.setattr(bench, "TOKENS", (1, 20))  # 20: past MAX_TOKENS, the shared expert walks two M tiles
    ceil = {"bandwidth": 4e12, "fp8_peak": 1e15, "bf16_peak": 5e14}
    with interpreter():
        rows = bench.bench(ceil, False, torch.Generator().manual_seed(0))
    # Toy gate/up: K 256, 2 blocks, the rule's 2 splits then the other divisor, 1; down: K 128, one split only.
    per_size = [
        "moe layer [one pass] (engine)",
        "moe layer [split-K]",
        "moe gate/up+swiglu fp8→fp8 [one pass] (engine)",
        "moe gate/up+swiglu fp8→fp8 [split-K]",
        "moe gate/up+swiglu fp8→fp8 [split-K ×1]",
        "moe down fp8→bf16 [one pass] (engine)",
        "moe down fp8→bf16 [split-K]",
    ]
    assert [r["kernel"] for r in rows] == per_size * 2
    notes = [r["note"] for r in rows]
    assert "FAIL" not in " ".join(notes) and sum("(one pass" in n and "ok ≤" in n for n in notes) == 2
    assert "rule: split-K" in notes[1] and "rule: one pass" in notes[8]  # batch 20 > moe_splitk.MAX_TOKENS
    assert all(r["us"] == 1000.0 for r in rows)
    # TB/s of the weight bytes alone: the layer reads 3·I·D e4m3 (+ scales) per active expert.
    active = int(rows[0]["shape"].split("active=")[1])
    assert rows[0]["tb_s"] == active * 3 * 128 * 256 * (1 + 4 / 128**2) / 1e-3 / 1e12
    # The layer pairs compute the same layer (the split-K one within the checked bound of the one pass).
    for first in (0, 7):  # 7 timed calls a size: 2 layers, 3 gate/up, 2 down
        one, split = outputs[first], outputs[first + 1]
        assert isinstance(one, torch.Tensor) and float((split - one).norm() / one.norm()) <= bench.LAYER_REL
