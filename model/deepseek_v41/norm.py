"""RMSNorm (spec §3.2): fp32 maths, weight applied before casting back; eps is 1e-20 in V4.1."""

from __future__ import annotations

import torch
from torch import nn


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Unweighted RMS normalisation in fp32; x [..., C] → fp32 [..., C]."""
    x = x.float()
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim] → [..., dim]
        return (self.weight.float() * rms_normalize(x, self.eps)).to(x.dtype)
