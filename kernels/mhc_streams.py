"""mHC's elementwise stream kernels (spec §3.3), shared with ``kernels/mhc.py``: Collapse
Σ_s pre_s · h_s and Expand post_k · y + Σ_j comb[j, k] · h_j, each alone (the final collapse, and
around Engram layers), and the ``_expand_stream`` tile helper that the fused expand+mix kernel uses.
Maths in fp32; the streams keep their dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from model.deepseek_v41.mhc import Mix


@triton.jit
def _expand_stream(y, h3, post_ptr, comb_ptr, t, t_ok, k, N: tl.constexpr, out_ty: tl.constexpr):
    """New stream k = post_k · y + Σ_j comb[j, k] · h_j on a [BT, BD] tile, from y [BT, BD] and the
    source streams h3 [BT, N, BD] (t [BT, 1] token ids), rounded to ``out_ty`` and back to fp32: what a
    consumer of the stored streams reads."""
    post = tl.load(post_ptr + t * N + k, mask=t_ok, other=0.0)  # [BT, 1]
    j = tl.arange(0, N)[None, :]
    comb = tl.load(comb_ptr + t * (N * N) + j * N + k, mask=t_ok, other=0.0)  # [BT, N]: column k
    return (post * y + tl.sum(comb[:, :, None] * h3, axis=1)).to(out_ty).to(tl.float32)


@triton.jit(do_not_specialize=("num_tokens",))
def _collapse_kernel(
    h_ptr,
    pre_ptr,
    x_ptr,
    num_tokens,
    dim,
    h_stride_t,
    h_stride_s,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t1 = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    d1 = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t, s, d = t1[:, None, None], tl.arange(0, N)[None, :, None], d1[None, None, :]
    ok = (t < num_tokens) & (d < dim)
    h = tl.load(h_ptr + t * h_stride_t + s * h_stride_s + d, mask=ok, other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + t * N + s, mask=t < num_tokens, other=0.0)
    x = tl.sum(pre * h, axis=1)
    x_ok = (t1 < num_tokens)[:, None] & (d1 < dim)[None, :]
    tl.store(x_ptr + t1[:, None] * dim + d1[None, :], x.to(x_ptr.dtype.element_ty), mask=x_ok)


@triton.jit(do_not_specialize=("num_tokens",))
def _expand_kernel(
    y_ptr,
    h_ptr,
    post_ptr,
    comb_ptr,
    out_ptr,
    num_tokens,
    dim,
    y_stride,
    h_stride_t,
    h_stride_s,
    N: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)[:, None]
    d = (tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
    t_ok = t < num_tokens
    ok = t_ok & (d < dim)
    y = tl.load(y_ptr + t * y_stride + d, mask=ok, other=0.0).to(tl.float32)
    h3 = tl.load(
        h_ptr + t[:, :, None] * h_stride_t + tl.arange(0, N)[None, :, None] * h_stride_s + d[:, None, :],
        mask=ok[:, None, :],
        other=0.0,
    ).to(tl.float32)  # [BT, N, BD]
    for k in tl.static_range(N):
        v = _expand_stream(y, h3, post_ptr, comb_ptr, t, t_ok, k, N, out_ptr.dtype.element_ty)
        tl.store(out_ptr + t * (N * dim) + k * dim + d, v.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------- launchers


def _streams(h: torch.Tensor) -> torch.Tensor:
    """[..., n, D] → [T, n, D] without a copy where the strides allow (the model's first h has stride 0 over n)."""
    h3 = h.reshape(-1, h.shape[-2], h.shape[-1])
    return h3 if h3.stride(-1) == 1 else h3.contiguous()


def _rows(y: torch.Tensor) -> torch.Tensor:
    y2 = y.reshape(-1, y.shape[-1])
    return y2 if y2.stride(-1) == 1 else y2.contiguous()


def _elementwise_config(num_tokens: int, dim: int) -> tuple[int, int, tuple[int, int]]:
    block_t = 1 if num_tokens < 64 else 4
    block_d = 1024 if num_tokens < 64 else 512
    return block_t, block_d, (triton.cdiv(num_tokens, block_t), triton.cdiv(dim, block_d))


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_s pre_s · h_s: h [..., n, D], pre fp32 [..., n] → [..., D] in h.dtype."""
    h3 = _streams(h)
    num_tokens, n, dim = h3.shape
    x = torch.empty(num_tokens, dim, device=h.device, dtype=h.dtype)
    if num_tokens:
        block_t, block_d, grid = _elementwise_config(num_tokens, dim)
        _collapse_kernel[grid](
            h3,
            pre.reshape(num_tokens, n).float().contiguous(),
            x,
            num_tokens,
            dim,
            h3.stride(0),
            h3.stride(1),
            N=n,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return x.view(*h.shape[:-2], dim)


def expand(y: torch.Tensor, h: torch.Tensor, mix: Mix) -> torch.Tensor:
    """New stream k = post_k · y + Σ_j comb[j, k] · h_j: y [..., D], h [..., n, D] → [..., n, D] in y.dtype."""
    h3, y2 = _streams(h), _rows(y)
    num_tokens, n, dim = h3.shape
    out = torch.empty(num_tokens, n, dim, device=h.device, dtype=y.dtype)
    if num_tokens:
        block_t, block_d, grid = _elementwise_config(num_tokens, dim)
        _expand_kernel[grid](
            y2,
            h3,
            mix.post.reshape(num_tokens, n).float().contiguous(),
            mix.comb.reshape(num_tokens, n, n).float().contiguous(),
            out,
            num_tokens,
            dim,
            y2.stride(0),
            h3.stride(0),
            h3.stride(1),
            N=n,
            BLOCK_T=block_t,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out.view(*h.shape)
