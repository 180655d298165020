"""The kernel backend's torch modules that reduce along a row, on fixed row tiles in the batch-invariant mode.

The kernel backend leaves a few row-wise modules in torch: the indexer's ``weights_proj`` (a bf16
nn.Linear: a cuBLAS GEMM) and, with a kernel set that has no ``engram_gate`` (``KernelSet.references()``),
Engram's gate (fp32 row norms and a dot: ATen reductions; otherwise ``KernelEngram`` runs it on a kernel,
services/worker/kernel_model/engram.py). cuBLAS and ATen pick their algorithm and reduction split from the whole
shape, the number of rows included, so a row's bits could follow the batch. Wrapped here, they run as one
call outside the mode and on ``kernels.invariance.ROW_CHUNK``-row tiles inside it (``invariance.by_rows``). Outside the
mode the wrappers change nothing.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels import invariance
from model.deepseek_v41.engram import Engram


class RowTiledLinear(nn.Module):
    """``linear`` (an nn.Linear, kept as a child) over rows: x [..., K] → [..., N]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = invariance.by_rows(self.linear, x.reshape(-1, x.shape[-1]))
        return out.view(*x.shape[:-1], out.shape[-1])


class RowTiledEngram(nn.Module):
    """``engram`` (kept as a child) over tokens: Engram's forward for h [B, S, n, D], rows [B, S, heads],
    live [B, S] or None → [B, S, n, D]. Padded tokens of a tile read embedding row 0 and are dropped."""

    def __init__(self, engram: Engram) -> None:
        super().__init__()
        self.engram = engram

    @property
    def embed(self) -> nn.Module:
        return self.engram.embed

    def forward(self, h: torch.Tensor, rows: torch.Tensor, live: torch.Tensor | None = None) -> torch.Tensor:
        if not invariance.active():
            return self.engram(h, rows, live)
        lead = h.shape[:2]
        flat = (h.reshape(-1, 1, *h.shape[2:]), rows.reshape(-1, 1, rows.shape[-1]))
        if live is None:
            out = invariance.by_rows(self.engram, *flat)
        else:
            out = invariance.by_rows(lambda h1, r1, l1: self.engram(h1, r1, l1), *flat, live.reshape(-1, 1))
        return out.view(*lead, *h.shape[2:])
