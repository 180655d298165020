"""An RMSNorm that feeds FP8 projections: ``kernels.rmsnorm.rmsnorm_quant`` computes its output and that
output's activation quantisation in one launch, and leaves both in the model's ``Fp8Handoff``
(services/worker/fp8_handoff.py), where the ``KernelLinear`` projections reading the output find them.
Its output is ``KernelRMSNorm``'s, bit for bit (the same norm kernel maths, the same tile shape)."""

from __future__ import annotations

import torch
from torch import nn

from model.deepseek_v41.norm import RMSNorm
from services.worker.fp8_handoff import MAX_ROWS, Fp8Handoff
from services.worker.fp8_linear import KernelSet


class QuantizingRMSNorm(nn.Module):
    """``KernelRMSNorm``'s output; with at most ``MAX_ROWS`` rows, its FP8 quantisation handed over
    under ``site`` (one slot per site: the next layer's norm there replaces it)."""

    def __init__(self, norm: RMSNorm, kernels: KernelSet, handoff: Fp8Handoff, site: str) -> None:
        super().__init__()
        self.eps, self.kernels, self.handoff, self.site = norm.eps, kernels, handoff, site
        self.weight = nn.Parameter(norm.weight.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] → [..., C] in x.dtype
        x2 = x.reshape(-1, x.shape[-1])
        if x2.shape[0] > MAX_ROWS:
            self.handoff.drop(self.site)
            return self.kernels.rmsnorm.rmsnorm(x.contiguous(), self.weight, self.eps)
        y, a = self.kernels.rmsnorm.rmsnorm_quant(x2, self.weight, self.eps)  # [T, C], (e4m3 [T, C'], [T, C'/128])
        self.handoff.put(self.site, y, a)
        return y.view(x.shape)

    def extra_repr(self) -> str:
        return f"site={self.site}"
