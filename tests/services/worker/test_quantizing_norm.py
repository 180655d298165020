"""The quantizing norm: KernelRMSNorm's output, and the FP8 projections reading it take its quantisation
(the same bits as quantising again, one launch fewer per projection)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from model.deepseek_v41.norm import RMSNorm
from services.worker import quantizing_norm
from services.worker.fp8_handoff import Fp8Handoff
from services.worker.fp8_linear import KernelLinear, KernelSet
from services.worker.kernel_moe import KernelRMSNorm
from tests.kernels.interpret import interpreter, load_interpreted


def _kernels() -> tuple[KernelSet, list[int]]:
    """Interpreted norm, quantiser and GEMM; ``calls`` counts the stand-alone quantiser's launches."""
    quant = load_interpreted("quant_fp8")
    calls: list[int] = []

    def quantize_act(x):
        calls.append(x.shape[0])
        return quant.quantize_act(x)

    kernels = KernelSet(load_interpreted("rmsnorm"), SimpleNamespace(quantize_act=quantize_act), None,
                        load_interpreted("moe_grouped_gemm"), None, interpreted=True)
    return kernels, calls


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(("rows", "channels"), [(3, 256), (2, 200)])
def test_projections_of_the_norm_take_its_quantisation_with_the_same_bits(rows, channels):
    gen = torch.Generator().manual_seed(channels)
    norm = RMSNorm(channels, 1e-6)
    norm.weight.data = torch.randn(channels, generator=gen)
    w_a, w_b = torch.randn(384, channels, generator=gen) / 16, torch.randn(128, channels, generator=gen) / 16
    x = (torch.randn(1, rows, channels, generator=gen) * 3).to(torch.bfloat16)
    kernels, calls = _kernels()
    handoff = Fp8Handoff()
    fused = quantizing_norm.QuantizingRMSNorm(norm, kernels, handoff, "attn_norm")
    plain = KernelRMSNorm(norm, kernels)
    with interpreter():
        y = fused(x)[0]  # a view of the norm's output, as the static decode step passes it
        outs = [KernelLinear(w, "fp8", kernels, handoff)(y) for w in (w_a, w_b)]
        fused_calls = len(calls)
        y0 = plain(x)[0]
        outs0 = [KernelLinear(w, "fp8", kernels)(y0) for w in (w_a, w_b)]
    assert fused_calls == 0 and len(calls) == 2  # no stand-alone quantiser after the quantizing norm
    assert torch.equal(_bits(y), _bits(y0))
    assert all(torch.equal(_bits(o), _bits(o0)) for o, o0 in zip(outs, outs0))


def test_above_max_rows_the_norm_hands_nothing_over(monkeypatch):
    monkeypatch.setattr(quantizing_norm, "MAX_ROWS", 2)
    norm = RMSNorm(128, 1e-6)
    kernels, calls = _kernels()
    handoff = Fp8Handoff()
    fused = quantizing_norm.QuantizingRMSNorm(norm, kernels, handoff, "q_norm")
    with interpreter():
        small = fused(torch.randn(2, 128))
        assert handoff.take(small, 128) is not None
        large = fused(torch.randn(3, 128))
        KernelLinear(torch.randn(128, 128), "fp8", kernels, handoff)(large)
    assert handoff.take(small, 128) is None and handoff.take(large, 128) is None  # the site's slot dropped
    assert calls == [3]


def test_conversion_keeps_plain_norms_without_the_fused_kernel_or_fp8_weights():
    """A kernel set without ``rmsnorm_quant`` (the torch references), or fp32 weights: no quantizing norms."""
    import copy

    from model.deepseek_v41.block import Block
    from model.deepseek_v41.presets import TINY
    from services.worker.kernel_backend import convert_model

    torch.manual_seed(0)
    block = Block(TINY, 0)  # one layer: attn_norm and attention's q_norm
    for precision, kernels, expected in (("fp8", KernelSet.references(), 0), ("fp32", _kernels()[0], 0),
                                         ("fp8", _kernels()[0], 2)):
        converted = copy.deepcopy(block)
        done = convert_model(converted, precision, kernels)
        quantizing = sum(isinstance(m, quantizing_norm.QuantizingRMSNorm) for m in converted.modules())
        assert done.norms > 0 and quantizing == expected
