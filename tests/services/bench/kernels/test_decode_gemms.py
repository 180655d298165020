"""services/bench/kernels/decode_gemms.py at toy sizes on CPU: the grouped GEMM interpreted, every timer
one call. The variants it times must compute what the engine's launches compute (same bits), or the
comparison would be between different work."""

from __future__ import annotations

import sys

import torch

from kernels.interpret import interpreter, load_interpreted
from services.bench import harness as timing
from services.bench.kernels import decode_gemms as gemms


def test_every_row_at_toy_sizes_and_the_variants_agree_bit_for_bit(monkeypatch):
    for name in ("moe_grouped_gemm", "quant_fp8"):
        monkeypatch.setitem(sys.modules, f"kernels.{name}", load_interpreted(name))
    outputs: list[torch.Tensor] = []

    def one_call(fn):
        out = fn()
        outputs.append(out[0] if isinstance(out, tuple) else out)
        return 1e-4

    monkeypatch.setattr(gemms, "_bench_replay", one_call)
    monkeypatch.setattr(timing, "DEVICE", "cpu")  # the shared weight maker's
    for name, value in (("DEVICE", "cpu"), ("HIDDEN", 256), ("INTER", 128), ("EXPERTS", 16), ("TOP_K", 2)):
        monkeypatch.setattr(gemms, name, value)
    monkeypatch.setattr(gemms, "projection_shapes", lambda: {"toy.wq": (256, 128), "toy.wo": (128, 256)})
    ceil = {"bandwidth": 4e12, "fp8_peak": 1e15, "bf16_peak": 5e14}
    with interpreter():
        rows = gemms.bench_moe_layer(40, ceil, torch.Generator().manual_seed(0))
        rows += gemms.bench_projections(40, ceil, torch.Generator().manual_seed(1))
    kinds = [r["kernel"] for r in rows]
    # T 40, top-2 of 16 + shared: ~7 slots per expert, BLOCK_M 16; the shared expert has 3 M tiles.
    assert kinds[:2] == [
        "moe layer gate/up+swiglu fp8→fp8 [m_split 1] (engine)",
        "moe layer gate/up+swiglu fp8→fp8 [m_split 3]",
    ]
    assert kinds[2:4] == ["moe layer down fp8→bf16 [m_split 1] (engine)", "moe layer down fp8→bf16 [m_split 3]"]
    assert kinds[4:6] == [
        "moe layer experts+combine [shared stacked]",
        "moe layer experts+combine [shared apart] (engine)",
    ]
    assert kinds[6:8] == ["projection toy.wq [BLOCK_M 16] (engine)", "projection toy.wq [BLOCK_M 32]"]
    assert len(rows) == 10 and all(r["us"] == 100.0 and r["tb_s"] > 0 for r in rows)
    # Each pair of variants writes the same values. Slots past an expert's count are never written
    # (uninitialised), so the MoE outputs compare on the written slots: those with a token in them.
    assert len(outputs) == 10
    assert torch.equal(outputs[4], outputs[5])  # the whole layer: the shared expert apart gives the same bits
    outputs = outputs[:4] + outputs[6:]
    written = gemms.layer_meta(40, torch.Generator().manual_seed(0))  # the same draws as the bench's
    mask = torch.arange(40)[None, :] < written["counts"][:, None]  # [E+1, cap]
    for first, second in (outputs[0:2], outputs[2:4]):
        assert torch.equal(first[mask].float(), second[mask].float())
    for first, second in (outputs[4:6], outputs[6:8]):  # projections: one expert, every slot written
        assert torch.equal(first, second)
