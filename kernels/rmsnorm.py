"""RMSNorm: y = weight · x / sqrt(mean(x²) + eps), fp32 maths, output in x's dtype (spec §3.2).

One program normalises ``ROWS`` rows; a row of C ≤ BLOCK_C channels is read once into registers
(C up to 16K here), so the kernel moves the fewest bytes: x in, y out, the weight once per program.
Reference: ``kernels.reference.rmsnorm``.

``rmsnorm_rope`` is attention's ``kv_norm`` with the step's RoPE folded in (one launch where there were
three: the norm and the two in-place complex multiplies of ``model.deepseek_v41.rope.apply_rope_``): y's
last 2P channels and every head's last 2P channels of the query are rotated as (even, odd) pairs by the
row's turns. A pair (a, b) times the turn (c, d) is (a·c − b·d, a·d + b·c), each product rounded and then
added, which is what torch's complex multiply computes on the CPU: bit-identical to ``apply_rope_`` there
for fp32 tensors (the only dtype it is used for).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CHANNELS = 16384
ROPE_PAIRS_PER_PROGRAM = 4096  # a query-rotating program's share: ROWS rows × BLOCK_H heads × P pairs


@triton.jit
def _rotate(a, b, c, d):
    """(a + bi)(c + di), as torch's complex multiply: (ac − bd, ad + bc)."""
    return a * c - b * d, a * d + b * c


@triton.jit(do_not_specialize=("num_rows",))
def _rmsnorm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    turn_ptr,
    q_ptr,
    num_rows,
    num_channels,
    x_row_stride,
    y_row_stride,
    eps,
    turn_row_stride,
    q_row_stride,
    q_head_stride,
    num_heads,
    q_dim,
    ROWS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # Program axis 1: 0 normalises (and with ROPE_PAIRS > 0 rotates y's last 2P channels); j ≥ 1 rotates
    # heads [(j−1)·BLOCK_H, j·BLOCK_H) of the query rows in place. The two never touch the same bytes.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < num_rows
    pairs = tl.arange(0, BLOCK_P)
    pair_ok = pairs < ROPE_PAIRS
    if tl.program_id(1) == 0:
        rope_start = num_channels - 2 * ROPE_PAIRS  # ROPE_PAIRS 0: every channel is stored plainly
        cols = tl.arange(0, BLOCK_C)
        col_ok = cols < num_channels
        mask = row_ok[:, None] & col_ok[None, :]
        # Masked lanes read 0, which adds nothing to the sum of squares; the mean divides by the true C.
        x_rows = x_ptr + rows[:, None].to(tl.int64) * x_row_stride
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=1) / num_channels + eps)
        y = w[None, :] * (x * inv_rms[:, None])
        y_rows = y_ptr + rows[:, None].to(tl.int64) * y_row_stride
        tl.store(y_rows + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask & (cols < rope_start)[None, :])
        if ROPE_PAIRS > 0:
            # The rotated channels again, as (even, odd) halves, with the same per-element maths as y's.
            even = rope_start + 2 * pairs
            pmask = row_ok[:, None] & pair_ok[None, :]
            we = tl.load(w_ptr + even, mask=pair_ok, other=0.0).to(tl.float32)
            wo = tl.load(w_ptr + even + 1, mask=pair_ok, other=0.0).to(tl.float32)
            xe = tl.load(x_rows + even[None, :], mask=pmask, other=0.0).to(tl.float32)
            xo = tl.load(x_rows + even[None, :] + 1, mask=pmask, other=0.0).to(tl.float32)
            ye = (we[None, :] * (xe * inv_rms[:, None])).to(y_ptr.dtype.element_ty).to(tl.float32)
            yo = (wo[None, :] * (xo * inv_rms[:, None])).to(y_ptr.dtype.element_ty).to(tl.float32)
            t_rows = turn_ptr + rows[:, None].to(tl.int64) * turn_row_stride + 2 * pairs[None, :]
            c = tl.load(t_rows, mask=pmask, other=0.0)
            d = tl.load(t_rows + 1, mask=pmask, other=0.0)
            re, im = _rotate(ye, yo, c, d)
            tl.store(y_rows + even[None, :], re.to(y_ptr.dtype.element_ty), mask=pmask)
            tl.store(y_rows + even[None, :] + 1, im.to(y_ptr.dtype.element_ty), mask=pmask)
    else:
        # [ROWS, BLOCK_H·BLOCK_P] lanes: (row, head, pair).
        lanes = tl.arange(0, BLOCK_H * BLOCK_P)
        heads = (tl.program_id(1) - 1) * BLOCK_H + lanes // BLOCK_P
        pair = lanes % BLOCK_P
        lane_ok = (heads < num_heads) & (pair < ROPE_PAIRS)
        qmask = row_ok[:, None] & lane_ok[None, :]
        q_at = (
            q_ptr
            + rows[:, None].to(tl.int64) * q_row_stride
            + heads[None, :].to(tl.int64) * q_head_stride
            + (q_dim - 2 * ROPE_PAIRS)
            + 2 * pair[None, :]
        )
        # Names of their own: the compiler types a name set in both branches alike, and these shapes differ.
        qa = tl.load(q_at, mask=qmask, other=0.0).to(tl.float32)
        qb = tl.load(q_at + 1, mask=qmask, other=0.0).to(tl.float32)
        q_turn = turn_ptr + rows[:, None].to(tl.int64) * turn_row_stride + 2 * pair[None, :]
        qc = tl.load(q_turn, mask=qmask, other=0.0)
        qd = tl.load(q_turn + 1, mask=qmask, other=0.0)
        q_re, q_im = _rotate(qa, qb, qc, qd)
        tl.store(q_at, q_re.to(q_ptr.dtype.element_ty), mask=qmask)
        tl.store(q_at + 1, q_im.to(q_ptr.dtype.element_ty), mask=qmask)


def _rows_per_program(block_c: int) -> int:
    """About 8K elements per program: several rows at small C, one row at large C."""
    return max(1, min(16, 8192 // block_c))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., C] (last dim contiguous) → [..., C] in x.dtype; ``out`` may be given (same shape)."""
    num_channels = x.shape[-1]
    _check(x, weight)
    x2 = x.reshape(-1, num_channels)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty_like(x2) if out is None else out.view(-1, num_channels)
    num_rows = x2.shape[0]
    if num_rows == 0:
        return y.view(x.shape)
    block_c = triton.next_power_of_2(num_channels)
    rows = _rows_per_program(block_c)
    _rmsnorm_kernel[(triton.cdiv(num_rows, rows), 1)](
        x2,
        weight,
        y,
        y,
        y,
        num_rows,
        num_channels,
        x2.stride(0),
        y.stride(0),
        eps,
        0,
        0,
        0,
        0,
        0,
        ROWS=rows,
        BLOCK_C=block_c,
        ROPE_PAIRS=0,
        BLOCK_P=1,
        BLOCK_H=1,
        num_warps=8 if block_c >= 4096 else 4,
    )
    return y.view(x.shape)


def rmsnorm_rope(
    x: torch.Tensor, weight: torch.Tensor, eps: float, turns: torch.Tensor, q: torch.Tensor
) -> torch.Tensor:
    """``apply_rope_(rmsnorm(x, weight, eps), turns)`` and ``apply_rope_(q, turns)`` in one launch.

    x [R, C] fp32 (last dim contiguous); turns complex64 [R, P] (``rope_turns``); q fp32 [R, H, Dq] (last
    dim contiguous), rotated in place. Returns y fp32 [R, C]."""
    _check(x, weight)
    num_rows, num_channels = x.shape
    num_heads, q_dim = q.shape[1:]
    num_pairs = turns.shape[-1]
    if x.dtype != torch.float32 or q.dtype != torch.float32 or turns.dtype != torch.complex64:
        raise ValueError(
            f"rmsnorm_rope takes fp32 x and q and complex64 turns, got {x.dtype}, {q.dtype}, {turns.dtype}"
        )
    if (
        x.stride(-1) != 1
        or q.stride(-1) != 1
        or turns.shape != (num_rows, num_pairs)
        or q.shape[0] != num_rows
        or 2 * num_pairs > min(num_channels, q_dim)
    ):
        raise ValueError(f"rmsnorm_rope: shapes x {tuple(x.shape)}, q {tuple(q.shape)}, turns {tuple(turns.shape)}")
    t = torch.view_as_real(turns)  # fp32 [R, P, 2], a view
    if t.stride(-1) != 1 or t.stride(-2) != 2:
        raise ValueError("rmsnorm_rope needs turns with contiguous pairs")
    y = torch.empty_like(x)
    if num_rows == 0:
        return y
    block_c, block_p = triton.next_power_of_2(num_channels), triton.next_power_of_2(num_pairs)
    rows = _rows_per_program(block_c)
    block_h = max(1, min(triton.next_power_of_2(num_heads), ROPE_PAIRS_PER_PROGRAM // (rows * block_p)))
    grid = (triton.cdiv(num_rows, rows), 1 + triton.cdiv(num_heads, block_h))
    _rmsnorm_kernel[grid](
        x,
        weight,
        y,
        t,
        q,
        num_rows,
        num_channels,
        x.stride(0),
        y.stride(0),
        eps,
        t.stride(0),
        q.stride(0),
        q.stride(1),
        num_heads,
        q_dim,
        ROWS=rows,
        BLOCK_C=block_c,
        ROPE_PAIRS=num_pairs,
        BLOCK_P=block_p,
        BLOCK_H=block_h,
        num_warps=8 if block_c >= 4096 else 4,
    )
    return y


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    num_channels = x.shape[-1]
    if num_channels > MAX_CHANNELS:
        raise ValueError(f"rmsnorm supports up to {MAX_CHANNELS} channels, got {num_channels}")
    if weight.shape != (num_channels,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({num_channels},)")
