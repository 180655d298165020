"""Engram on the kernel backend: the model's embedding lookup and wkv projection, then ``kernels.engram_gate``
(the gate and the residual add in one launch) where the model runs about 23 torch ops.

The model's ``Engram`` is kept as the child ``engram`` (its ``embed`` and ``wkv``, the latter a
``KernelLinear`` after conversion, and its ``q_weight``/``k_weight``/``eps``): the torch reference of this
module is ``engram.forward``. Every piece is row-wise by construction (an embedding gather, the FP8 linear's
fixed tiles in the batch-invariant mode, one gate program per token and stream), so unlike
``RowTiledEngram`` it needs no row tiling in the batch-invariant mode: one call in both modes.
"""

from __future__ import annotations

import torch
from torch import nn

from model.deepseek_v41.engram import Engram
from services.worker.kernel_model.kernel_set import KernelSet


class KernelEngram(nn.Module):
    """``Engram``'s forward for h [B, S, n, D], rows [B, S, heads], live [B, S] or None → [B, S, n, D] in h's
    dtype, with the gate on ``kernels.engram_gate`` (compiled, or an interpreted copy called inside
    ``interpreter()``)."""

    def __init__(self, engram: Engram, kernels: KernelSet) -> None:
        super().__init__()
        self.engram, self.kernels = engram, kernels

    @property
    def embed(self) -> nn.Module:
        return self.engram.embed

    def forward(self, h: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        engram = self.engram
        key, value = engram.project(h, rows)  # views of one [B, S, (n+1)·D] product
        lead, streams = h.shape[:-2], h.shape[-2:]
        out = self.kernels.engram_gate.engram_gate(
            h.reshape(-1, *streams),
            key.reshape(-1, key.shape[-1]),
            value.reshape(-1, value.shape[-1]),
            engram.q_weight,
            engram.k_weight,
            engram.eps,
            None if live is None else live.reshape(-1),
        )
        return out.view(*lead, *streams)
