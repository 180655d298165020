"""Engram's gate and residual add in one launch: out[t, i] = h[t, i] + gate[t, i] · value[t] (spec §3.8).

For token t and stream i, in fp32 (the formula of ``model.deepseek_v41.engram.Engram.forward``):

    rstd = rsqrt(mean(h²) + eps) · rsqrt(mean(key²) + eps)
    dot  = Σ_d h · (q_weight · k_weight) · key · rstd · D^-½
    gate = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)),  0 for a dead token (``live`` False)

with key[t, i] the i-th D-wide slice of key [T, n·D] and value [T, D] shared by the n streams; the
output is in h's dtype. Replaces about 23 torch ops (casts, the two norms, the weight product, the dot,
the signed sqrt, sigmoid, the mask, the residual add).

Invariant: one program per (token, stream), whose reductions run over that row's D channels only,
in an order fixed by D (``BLOCK_D``): a row's bits never depend on the number of tokens or on the
other rows, in or out of the batch-invariant mode. key and value are read at their row strides, so
the split of wkv's output ([T, (n+1)·D]) is passed as two views, with no copy. q_weight and k_weight
are multiplied in-kernel (one fp32 rounding, as the model's ``q_weight.float() * k_weight.float()``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_CHANNELS = 16384
SQRT_FLOOR = 1e-6  # the gate's signed sqrt clamps |dot| from below (Engram.forward's clamp_min)


@triton.jit
def _engram_gate_kernel(
    h_ptr,
    key_ptr,
    value_ptr,
    qw_ptr,
    kw_ptr,
    live_ptr,
    out_ptr,
    dim,
    h_row_stride,
    h_stream_stride,
    key_row_stride,
    value_row_stride,
    out_row_stride,
    out_stream_stride,
    weight_stream_stride,
    eps,
    scale,
    floor,
    HAS_LIVE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    stream = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < dim
    # Masked lanes read 0: they add nothing to the three sums, and the means divide by the true D.
    h = tl.load(h_ptr + token * h_row_stride + stream * h_stream_stride + cols, mask=ok, other=0.0).to(tl.float32)
    k = tl.load(key_ptr + token * key_row_stride + stream * dim + cols, mask=ok, other=0.0).to(tl.float32)
    qw = tl.load(qw_ptr + stream * weight_stream_stride + cols, mask=ok, other=0.0).to(tl.float32)
    kw = tl.load(kw_ptr + stream * weight_stream_stride + cols, mask=ok, other=0.0).to(tl.float32)
    v = tl.load(value_ptr + token * value_row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / dim + eps) * tl.rsqrt(tl.sum(k * k, axis=0) / dim + eps)
    dot = tl.sum(h * (qw * kw) * k, axis=0) * rstd * scale
    root = tl.sqrt_rn(tl.maximum(tl.abs(dot), floor))
    # copysign: the sign bit decides, so −0.0 gives −root as torch.copysign does.
    gate = tl.sigmoid(tl.where(dot.to(tl.int32, bitcast=True) < 0, -root, root))
    if HAS_LIVE:
        gate = tl.where(tl.load(live_ptr + token) != 0, gate, 0.0)
    out = h + gate * v
    tl.store(
        out_ptr + token * out_row_stride + stream * out_stream_stride + cols, out.to(out_ptr.dtype.element_ty), mask=ok
    )


def engram_gate(
    h: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    live: torch.Tensor | None = None,
) -> torch.Tensor:
    """h [T, n, D], key [T, n·D], value [T, D] (each last dim contiguous; rows at any stride),
    q_weight/k_weight [n, D], live bool [T] or None (every token live) → out [T, n, D] in h's dtype."""
    num_tokens, num_streams, dim = h.shape
    if dim > MAX_CHANNELS:
        raise ValueError(f"engram_gate supports up to {MAX_CHANNELS} channels, got {dim}")
    if key.shape != (num_tokens, num_streams * dim) or value.shape != (num_tokens, dim):
        raise ValueError(f"engram_gate: h {tuple(h.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    if q_weight.shape != (num_streams, dim) or k_weight.shape != (num_streams, dim):
        raise ValueError(
            f"engram_gate: q_weight {tuple(q_weight.shape)} and k_weight {tuple(k_weight.shape)} "
            f"must be ({num_streams}, {dim})"
        )
    if live is not None and (live.shape != (num_tokens,) or live.dtype != torch.bool):
        raise ValueError(f"live must be bool [{num_tokens}], got {live.dtype} {tuple(live.shape)}")
    if h.stride(-1) != 1:
        h = h.contiguous()
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if q_weight.stride() != k_weight.stride() or q_weight.stride(-1) != 1:
        q_weight, k_weight = q_weight.contiguous(), k_weight.contiguous()
    out = torch.empty((num_tokens, num_streams, dim), dtype=h.dtype, device=h.device)
    if num_tokens == 0:
        return out
    live_bytes = None if live is None else live.view(torch.uint8).contiguous()
    block_d = triton.next_power_of_2(dim)
    _engram_gate_kernel[(num_tokens, num_streams)](
        h,
        key,
        value,
        q_weight,
        k_weight,
        h if live_bytes is None else live_bytes,
        out,
        dim,
        h.stride(0),
        h.stride(1),
        key.stride(0),
        value.stride(0),
        out.stride(0),
        out.stride(1),
        q_weight.stride(0),
        eps,
        dim**-0.5,
        SQRT_FLOOR,
        HAS_LIVE=live_bytes is not None,
        BLOCK_D=block_d,
        num_warps=8 if block_d >= 4096 else 4,
    )
    return out
