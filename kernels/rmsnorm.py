"""RMSNorm: y = weight · x / sqrt(mean(x²) + eps), fp32 maths, output in x's dtype (spec §3.2).

One program normalises ``ROWS`` rows; a row of C ≤ BLOCK_C channels is read once into registers
(C up to 16K here), so the kernel moves the fewest bytes: x in, y out, the weight once per program.
Reference: ``kernels.reference.rmsnorm``.

``rmsnorm_quant`` is the norm that feeds an FP8 projection: the same y, and in the same launch y's
activation quantisation (``kernels.quant_fp8.quantize_act`` of y zero-padded to a multiple of 128,
bit for bit): one launch and one read of x instead of a norm and a quantiser per consumer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_fp8 import _quantize_rows
from kernels.reference import GROUP

MAX_CHANNELS = 16384


@triton.jit
def _norm_rows(x_ptr, w_ptr, rows, cols, num_rows, num_channels, x_row_stride, eps):
    """fp32 y [ROWS, BLOCK_C] of rows ``rows``; 0 in masked lanes (rows past the end, cols ≥ C)."""
    col_ok = cols < num_channels
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    # Masked lanes read 0, which adds nothing to the sum of squares; the mean divides by the true C.
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / num_channels + eps)
    return w[None, :] * (x * inv_rms[:, None])


@triton.jit
def _rmsnorm_kernel(
    x_ptr, w_ptr, y_ptr,
    num_rows, num_channels, x_row_stride, y_row_stride, eps,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    y = _norm_rows(x_ptr, w_ptr, rows, cols, num_rows, num_channels, x_row_stride, eps)
    mask = (rows < num_rows)[:, None] & (cols < num_channels)[None, :]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * y_row_stride + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmsnorm_quant_kernel(
    x_ptr, w_ptr, y_ptr, q_ptr, s_ptr,
    num_rows, num_channels, x_row_stride, eps,
    GROUPS: tl.constexpr, ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """y [T, C] as ``_rmsnorm_kernel``; q e4m3 [T, GROUPS·128] and s fp32 [T, GROUPS] quantise y *as
    stored* (cast to y's dtype and back), so they equal ``quantize_act`` reading y. Channels in
    [C, GROUPS·128) are 0 in y's registers (masked x and weight), as zero padding gives."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    row_ok = rows < num_rows
    y = _norm_rows(x_ptr, w_ptr, rows, cols, num_rows, num_channels, x_row_stride, eps).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None].to(tl.int64) * num_channels + cols[None, :], y,
             mask=row_ok[:, None] & (cols < num_channels)[None, :])
    q_rows = q_ptr + rows[:, None].to(tl.int64) * (GROUPS * 128)
    if BLOCK_C >= 128:
        # [ROWS, BLOCK_C] → [ROWS · BLOCK_C/128, 128]: one quantisation group per row of the view.
        q, scale = _quantize_rows(tl.reshape(y.to(tl.float32), (ROWS * (BLOCK_C // 128), 128)))
        tl.store(q_rows + cols[None, :], tl.reshape(q, (ROWS, BLOCK_C)),
                 mask=row_ok[:, None] & (cols < GROUPS * 128)[None, :])
        g = tl.arange(0, BLOCK_C // 128)
        tl.store(s_ptr + rows[:, None].to(tl.int64) * GROUPS + g[None, :], tl.reshape(scale, (ROWS, BLOCK_C // 128)),
                 mask=row_ok[:, None] & (g < GROUPS)[None, :])
    else:
        # One group (GROUPS = 1) wider than the row: its amax is the row's; the channels past BLOCK_C are 0.
        q, scale = _quantize_rows(y.to(tl.float32))
        tl.store(q_rows + cols[None, :], q, mask=row_ok[:, None])
        pad = tl.arange(0, 128)
        tl.store(q_rows + pad[None, :], tl.zeros((ROWS, 128), dtype=tl.float32).to(q_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (pad >= BLOCK_C)[None, :])
        tl.store(s_ptr + rows.to(tl.int64), scale, mask=row_ok)


def _config(num_channels: int) -> tuple[int, int, int]:
    """(BLOCK_C, ROWS, warps) from C alone, shared by both kernels so a row's sum of squares is reduced
    in the same shape (and order) by either. About 8K elements per program: several rows at small C,
    one row at large C."""
    block_c = triton.next_power_of_2(num_channels)
    return block_c, max(1, min(16, 8192 // block_c)), 8 if block_c >= 4096 else 4


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
    block_c, rows, num_warps = _config(num_channels)
    grid = (triton.cdiv(num_rows, rows),)
    _rmsnorm_kernel[grid](
        x2, weight, y, num_rows, num_channels, x2.stride(0), y.stride(0), eps,
        ROWS=rows, BLOCK_C=block_c, num_warps=num_warps,
    )
    return y.view(x.shape)


def rmsnorm_quant(x: torch.Tensor, weight: torch.Tensor, eps: float
                  ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """x [T, C] → (y [T, C] in x.dtype, contiguous: ``rmsnorm(x)``'s bits; (e4m3 [T, C'], fp32 [T, C'/128])
    = ``quantize_act`` of y zero-padded to C' = C rounded up to 128)."""
    num_rows, num_channels = x.shape
    if num_channels > MAX_CHANNELS:
        raise ValueError(f"rmsnorm supports up to {MAX_CHANNELS} channels, got {num_channels}")
    if weight.shape != (num_channels,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({num_channels},)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = triton.cdiv(num_channels, GROUP)
    y = torch.empty(num_rows, num_channels, dtype=x.dtype, device=x.device)
    q = torch.empty(num_rows, groups * GROUP, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(num_rows, groups, dtype=torch.float32, device=x.device)
    if num_rows:
        block_c, rows, num_warps = _config(num_channels)
        _rmsnorm_quant_kernel[(triton.cdiv(num_rows, rows),)](
            x, weight, y, q, s, num_rows, num_channels, x.stride(0), eps,
            GROUPS=groups, ROWS=rows, BLOCK_C=block_c, num_warps=num_warps,
        )
    return y, (q, s)
