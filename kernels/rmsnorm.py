"""RMSNorm: y = weight · x / sqrt(mean(x²) + eps), fp32 maths, output in x's dtype (spec §3.2).

One program normalises ``ROWS`` rows; a row of C ≤ BLOCK_C channels is read once into registers
(C up to 16K here), so the kernel moves the fewest bytes: x in, y out, the weight once per program.
Reference: ``kernels.reference.rmsnorm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CHANNELS = 16384


@triton.jit
def _rmsnorm_kernel(
    x_ptr, w_ptr, y_ptr,
    num_rows, num_channels, x_row_stride, y_row_stride, eps,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    col_ok = cols < num_channels
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    # Masked lanes read 0, which adds nothing to the sum of squares; the mean divides by the true C.
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / num_channels + eps)
    y = w[None, :] * (x * inv_rms[:, None])
    tl.store(y_ptr + rows[:, None].to(tl.int64) * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., C] (last dim contiguous) → [..., C] in x.dtype; ``out`` may be given (same shape)."""
    num_channels = x.shape[-1]
    if num_channels > MAX_CHANNELS:
        raise ValueError(f"rmsnorm supports up to {MAX_CHANNELS} channels, got {num_channels}")
    if weight.shape != (num_channels,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({num_channels},)")
    x2 = x.reshape(-1, num_channels)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2) if out is None else out.view(-1, num_channels)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return y.view(x.shape)
    block_c = triton.next_power_of_2(num_channels)
    # Keep about 8K elements per program: several rows at small C, one row at large C.
    rows = max(1, min(16, 8192 // block_c))
    num_warps = 8 if block_c >= 4096 else 4
    grid = (triton.cdiv(num_rows, rows),)
    _rmsnorm_kernel[grid](
        x2, weight, y, num_rows, num_channels, x2.stride(0), y.stride(0), eps,
        ROWS=rows, BLOCK_C=block_c, num_warps=num_warps,
    )
    return y.view(x.shape)
