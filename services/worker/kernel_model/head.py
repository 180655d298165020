"""The output head on the kernel backend: fp32 logits from the checkpoint's bf16 weight, read as bf16.

The model computes ``F.linear(y.float(), W.float())``: an fp32 GEMM over the [vocab, D] weight, which
the checkpoint stores in bf16 (checkpoint.py). Held in fp32 it is 2.6 GB read per step at v41 widths
(twice the 1.3 GB the floor counts) and an FFMA GEMM at large batches (docs/performance.md, "Kernels").
``KernelHead`` keeps W in bf16, which is exact, and on CUDA runs one bf16 tensor-core GEMM with fp32 accumulation and
fp32 output (``torch.mm(..., out_dtype=torch.float32)``, cuBLAS) over the rows [y_hi; y_lo], both bf16 with
y_hi + y_lo = y to within 2^-17 |y|; the two halves of the output are added. W is used exactly and y to 16 bits of
mantissa, where the fp32 GEMM has 24: the logits move by a few 1e-6 relative. A bf16 y is exact as y_hi, so y_lo is
skipped. Off CUDA (the interpreted CPU tests) it is the model's fp32 product, bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import invariance


def exact_in_bf16(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 or torch.equal(weight.to(torch.bfloat16).float(), weight.float())


class KernelHead(nn.Module):
    """The model's ``head`` (an nn.Linear without bias, W [vocab, D] exact in bf16): y [..., D] → fp32 logits."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if not exact_in_bf16(weight):
            raise ValueError("the head weight is not exact in bf16: keep the fp32 nn.Linear")
        self.register_buffer("weight", weight.detach().to(torch.bfloat16).contiguous())  # [vocab, D]

    def forward(self, y: torch.Tensor) -> torch.Tensor:  # [..., D] → fp32 [..., vocab]
        y2 = y.reshape(-1, y.shape[-1])  # [G, D]
        out = invariance.by_rows(self._logits, y2)  # fixed-row GEMM calls in the batch-invariant mode
        return out.view(*y.shape[:-1], out.shape[-1])

    def _logits(self, y2: torch.Tensor) -> torch.Tensor:  # [G, D] → fp32 [G, vocab]
        if y2.device.type != "cuda":
            return F.linear(y2.float(), self.weight.float())
        if y2.dtype == torch.bfloat16:
            out = torch.mm(y2, self.weight.t(), out_dtype=torch.float32)
        else:
            x = y2.float()
            hi = x.to(torch.bfloat16)
            lo = (x - hi.float()).to(torch.bfloat16)
            both = torch.mm(torch.cat([hi, lo]), self.weight.t(), out_dtype=torch.float32)  # [2G, vocab]
            out = both[: x.shape[0]] + both[x.shape[0] :]
        return out

    def extra_repr(self) -> str:
        return f"in={self.weight.shape[1]}, out={self.weight.shape[0]}, bf16 weight, fp32 logits"


def head_logits(head: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """fp32 logits of y [..., D]: the kernel head's, or the model's fp32 product for an nn.Linear."""
    if isinstance(head, KernelHead):
        return head(y)
    y2 = y.reshape(-1, y.shape[-1])
    out = invariance.by_rows(lambda rows: F.linear(rows.float(), head.weight.float()), y2)
    return out.view(*y.shape[:-1], out.shape[-1])
