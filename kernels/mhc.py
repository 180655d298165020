"""mHC (spec §3.3): the Sinkhorn mix, collapse and expand of the n residual streams, in Triton.

Semantics are ``model/deepseek_v41/mhc.py`` (``HyperConnection.forward``, ``collapse``, ``expand``);
all mixing maths is fp32, the streams keep their dtype. Entry points, h [T, n, D] (or [..., n, D]):

- ``mhc_mix(h, w, collapse_pre)``: one site's Mix of h, and optionally Collapse(h, collapse_pre) from
  the same read of h (the model collapses with the *previous* site's pre at every site).
- ``mhc_expand_mix(y, h, mix, w, collapse_pre)``: h' = Expand(y, h, mix), then Mix(h') and
  optionally Collapse(h', collapse_pre), reading h and y once and writing h' once: every site
  after the first in a layer chain is this one kernel.
- ``collapse(h, pre)`` and ``expand(y, h, mix)`` alone (the final collapse; around Engram layers),
  from ``kernels/mhc_streams.py`` with the stream helpers the mix kernel shares.

The mix kernel tiles tokens × D: a program owns BLOCK_T tokens and a range of D tiles, reads each
[BLOCK_T, BLOCK_D] stream tile once (all n when expanding) and feeds the projection fn·v one stream at
a time as tf32 tl.dots that are fp32-accurate: fn is split once (``MixWeights``) into a tf32-exact part
and the rest, and bf16 streams are exact in tf32, so v · fn_hi is exact and v · fn_lo errs by 2^-11 of
a 2^-11-sized term (fp32 streams add a v_lo · fn_hi pass). At small T the D range is split over
programs; their partial products and sums of squares go to a small fp32 buffer, and a finishing
kernel runs the epilogue (scale/bias, sigmoids, 20 Sinkhorn iterations on the n×n matrix in
registers), in a fixed order: results do not depend on the schedule. At one token (decode at batch 1) the
mix launch's last program finishes instead (a ticket, kernels/tickets.py), with the same code: the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels import invariance
from kernels.mhc_streams import _expand_stream, _rows, _streams, collapse, expand  # noqa: F401 - re-exported
from kernels.tickets import tickets
from model.deepseek_v41.mhc import Mix

NUM_SMS_H200 = 132
FINISH_IN_MIX_MAX_TOKENS = 1
"""Up to this many tokens the split mix is finished inside its own launch by the last program, one token
after another; above it the finishing kernel's one-token programs run side by side. At T = 1 the one
launch does the same work in the same order with one launch fewer; each further token adds a serial
finish (three loads and the Sinkhorn iterations) against the launch it saves, unmeasured."""


class MixWeights(NamedTuple):
    """One site's parameters: fn_split fp32 [2, n(n+2), n·D] (fn = [0] + [1], [0] exact in tf32),
    base fp32 [n(n+2)], scale fp32 [3]. Build with ``of`` or ``make``: the split is done once."""

    fn_split: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    iters: int
    eps: float
    norm_eps: float

    @classmethod
    def of(cls, hc: torch.nn.Module) -> MixWeights:
        """From a ``model.deepseek_v41.mhc.HyperConnection``."""
        return cls.make(hc.fn.detach(), hc.base.detach(), hc.scale.detach(), hc.iters, hc.eps, hc.norm_eps)

    @classmethod
    def make(
        cls, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float, norm_eps: float
    ) -> MixWeights:
        fn = fn.float().contiguous()
        hi = (fn.view(torch.int32) & -8192).view(torch.float32)  # 10 mantissa bits: exact in tf32
        return cls(
            torch.stack((hi, fn - hi)), base.float().contiguous(), scale.float().contiguous(), iters, eps, norm_eps
        )


class MixResult(NamedTuple):
    mix: Mix  # of ``h``
    h: torch.Tensor  # [T, n, D]: the streams mixed (the new streams for mhc_expand_mix)
    x: torch.Tensor | None  # [T, D] in h.dtype: Collapse(h, collapse_pre), when asked for


@triton.jit
def _mix_epilogue(
    m,
    sumsq,
    t0,
    num_tokens,
    k_total,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    norm_eps,
    eps,
    ITERS: tl.constexpr,
    N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """m [BT, ROWS·N] = fn·v (column c = row c // N, lane c % N), sumsq [BT] = Σ v² → pre, post, comb.

    Rows of the [BT, ROWS, N] view: 0 pre, 1 post, 2 … N+1 the comb matrix (row = source stream),
    the rest padding. Padding rows are zeroed before the Sinkhorn column sums and stay 0."""
    t = (t0 + tl.arange(0, BLOCK_T))[:, None, None]
    r = tl.arange(0, ROWS)[None, :, None]
    k = tl.arange(0, N)[None, None, :]
    col = r * N + k
    base = tl.load(base_ptr + col, mask=col < N * (N + 2), other=0.0)
    scale = tl.load(scale_ptr + tl.minimum(r, 2))
    inv_rms = tl.rsqrt(sumsq / k_total + norm_eps)[:, None, None]
    logits = base + (tl.reshape(m, (BLOCK_T, ROWS, N)) * inv_rms) * scale
    sig = tl.sigmoid(logits)
    t_ok = t < num_tokens
    lane = t * N + k + 0 * r  # [BT, ROWS, N]: only row 0 (pre) / row 1 (post) is stored
    tl.store(pre_ptr + lane, sig + eps, mask=t_ok & (r == 0))
    tl.store(post_ptr + lane, 2 * sig, mask=t_ok & (r == 1))
    is_comb = (r >= 2) & (r < N + 2)
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    c = tl.where(is_comb, e / tl.sum(e, axis=2)[:, :, None] + eps, 0.0)
    c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    for _ in range(ITERS - 1):
        c = c / (tl.sum(c, axis=2)[:, :, None] + eps)
        c = c / (tl.sum(c, axis=1)[:, None, :] + eps)
    tl.store(comb_ptr + t * (N * N) + (r - 2) * N + k, c, mask=t_ok & is_comb)


@triton.jit(do_not_specialize=("num_tokens",))
def _mix_kernel(
    h_ptr,
    y_ptr,
    in_post_ptr,
    in_comb_ptr,
    h_out_ptr,
    cpre_ptr,
    x_ptr,
    fn_ptr,
    base_ptr,
    scale_ptr,
    part_ptr,
    sq_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    ticket_ptr,
    num_tokens,
    dim,
    h_stride_t,
    h_stride_s,
    y_stride,
    norm_eps,
    eps,
    N: tl.constexpr,
    TILES: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr,
    EXPAND: tl.constexpr,
    COLLAPSE: tl.constexpr,
    ITERS: tl.constexpr,
    V_EXACT: tl.constexpr,
    FINISH: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
):
    """Grid (token tiles, SPLIT); split i owns D tiles [i·TILES, (i+1)·TILES). h_out [T, N, D] and
    x [T, D] are contiguous; part [SPLIT, T, ROWS·N], sq [SPLIT, T]. The K = N·D projection runs one
    stream at a time: acc += v_k [BT, BD] · fn[:, k·D + d]ᵀ [BD, ROWS·N]. V_EXACT: the streams are
    bf16/fp16, exact in tf32. FINISH (SPLIT > 1): the tile's last program to store its partials (ticket
    [token tiles] int32, kernels/tickets.py) runs ``_finish`` one token at a time, as ``_mix_finish_kernel``'s
    one-token programs do (else that kernel does, in a second launch)."""
    t0 = tl.program_id(0) * BLOCK_T
    split = tl.program_id(1)
    t1 = (t0 + tl.arange(0, BLOCK_T)).to(tl.int64)
    t = t1[:, None]  # [BT, 1]
    t_ok = t < num_tokens
    c = tl.arange(0, ROWS * N)[:, None]  # [ROWS·N, 1] fn rows; ≥ N(N+2) are padding
    k_total = N * dim
    acc = tl.zeros((BLOCK_T, ROWS * N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for i in range(TILES):  # constexpr trip count: the interpreter (Triton 3.6) rejects runtime bounds
        d = ((split * TILES + i) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]  # [1, BD]
        ok = t_ok & (d < dim)
        if EXPAND:
            y = tl.load(y_ptr + t * y_stride + d, mask=ok, other=0.0).to(tl.float32)
            h3 = tl.load(
                h_ptr + t[:, :, None] * h_stride_t + tl.arange(0, N)[None, :, None] * h_stride_s + d[:, None, :],
                mask=ok[:, None, :],
                other=0.0,
            ).to(tl.float32)  # [BT, N, BD]
        if COLLAPSE:
            x = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for k in range(N):  # a loop, not tl.static_range: fewer live tiles (the fn operand dominates)
            if EXPAND:
                v = _expand_stream(y, h3, in_post_ptr, in_comb_ptr, t, t_ok, k, N, h_out_ptr.dtype.element_ty)
                tl.store(h_out_ptr + t * k_total + k * dim + d, v.to(h_out_ptr.dtype.element_ty), mask=ok)
            else:
                v = tl.load(h_ptr + t * h_stride_t + k * h_stride_s + d, mask=ok, other=0.0).to(tl.float32)
            if COLLAPSE:
                x += tl.load(cpre_ptr + t * N + k, mask=t_ok, other=0.0) * v
            sumsq += tl.sum(v * v, axis=1)
            w_ptr = fn_ptr + c * k_total + k * dim + d
            w_ok = (c < N * (N + 2)) & (d < dim)
            w_hi = tl.trans(tl.load(w_ptr, mask=w_ok, other=0.0))
            w_lo = tl.trans(tl.load(w_ptr + N * (N + 2) * k_total, mask=w_ok, other=0.0))
            if V_EXACT:
                acc = tl.dot(v, w_lo, acc, input_precision="tf32")
                acc = tl.dot(v, w_hi, acc, input_precision="tf32")
            else:
                v_hi = (v.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
                acc = tl.dot(v, w_lo, acc, input_precision="tf32")
                acc = tl.dot(v - v_hi, w_hi, acc, input_precision="tf32")
                acc = tl.dot(v_hi, w_hi, acc, input_precision="tf32")
        if COLLAPSE:
            tl.store(x_ptr + t * dim + d, x.to(x_ptr.dtype.element_ty), mask=ok)
    if SPLIT == 1:
        _mix_epilogue(
            acc,
            sumsq,
            t0,
            num_tokens,
            k_total,
            base_ptr,
            scale_ptr,
            pre_ptr,
            post_ptr,
            comb_ptr,
            norm_eps,
            eps,
            ITERS,
            N,
            ROWS,
            BLOCK_T,
        )
    else:
        row = split * num_tokens + t1
        tl.store(part_ptr + row[:, None] * (ROWS * N) + tl.arange(0, ROWS * N)[None, :], acc, mask=t_ok)
        tl.store(sq_ptr + row, sumsq, mask=t1 < num_tokens)
        if FINISH:
            # Every thread's partials are stored before the ticket is taken (the barrier), and released with
            # it; the last program's acquire makes all SPLIT programs' partials visible to it.
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                for i in range(BLOCK_T):
                    if t0 + i < num_tokens:
                        _finish(
                            part_ptr,
                            sq_ptr,
                            t0 + i,
                            base_ptr,
                            scale_ptr,
                            pre_ptr,
                            post_ptr,
                            comb_ptr,
                            num_tokens,
                            k_total,
                            norm_eps,
                            eps,
                            SPLIT,
                            SPLIT_BLOCK,
                            N,
                            ROWS,
                            1,
                            ITERS,
                            True,
                        )
                tl.store(ticket_ptr + tl.program_id(0), 0)  # 0 again for the next launch or graph replay


@triton.jit
def _finish(
    part_ptr,
    sq_ptr,
    t0,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    num_tokens,
    k_total,
    norm_eps,
    eps,
    SPLIT: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ITERS: tl.constexpr,
    FROM_L2: tl.constexpr,
):
    """Sums the SPLIT partial products of tokens t0 … t0 + BLOCK_T − 1, SPLIT_BLOCK splits per load (a tree
    sum of each block, blocks in order: a fixed order for a given shape and warp count, so deterministic),
    then the epilogue. FROM_L2: read at L2 (".cg"), for partials other programs of this launch wrote."""
    t = t0 + tl.arange(0, BLOCK_T)  # [BT]
    s = tl.arange(0, SPLIT_BLOCK)[:, None]  # [SB, 1]
    cols = tl.arange(0, ROWS * N)[None, None, :]  # [1, 1, ROWS·N]
    m = tl.zeros((BLOCK_T, ROWS * N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for s0 in range(0, SPLIT, SPLIT_BLOCK):  # constexpr bounds (the interpreter rejects runtime ones)
        row = (s0 + s) * num_tokens + t[None, :]  # [SB, BT]
        ok = (s0 + s < SPLIT) & (t[None, :] < num_tokens)
        if FROM_L2:
            m += tl.sum(
                tl.load(
                    part_ptr + row[:, :, None] * (ROWS * N) + cols, mask=ok[:, :, None], other=0.0, cache_modifier=".cg"
                ),
                axis=0,
            )
            sumsq += tl.sum(tl.load(sq_ptr + row, mask=ok, other=0.0, cache_modifier=".cg"), axis=0)
        else:
            m += tl.sum(tl.load(part_ptr + row[:, :, None] * (ROWS * N) + cols, mask=ok[:, :, None], other=0.0), axis=0)
            sumsq += tl.sum(tl.load(sq_ptr + row, mask=ok, other=0.0), axis=0)
    _mix_epilogue(
        m,
        sumsq,
        t0,
        num_tokens,
        k_total,
        base_ptr,
        scale_ptr,
        pre_ptr,
        post_ptr,
        comb_ptr,
        norm_eps,
        eps,
        ITERS,
        N,
        ROWS,
        BLOCK_T,
    )


@triton.jit(do_not_specialize=("num_tokens",))
def _mix_finish_kernel(
    part_ptr,
    sq_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    num_tokens,
    k_total,
    norm_eps,
    eps,
    SPLIT: tl.constexpr,
    SPLIT_BLOCK: tl.constexpr,
    N: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    ITERS: tl.constexpr,
):
    """``_finish`` of a token tile per program. One load per block, not per split: at T = 1 the split
    count is 320 (D 5120), and a chain of 320 dependent loads made the launch latency-bound."""
    _finish(
        part_ptr,
        sq_ptr,
        tl.program_id(0) * BLOCK_T,
        base_ptr,
        scale_ptr,
        pre_ptr,
        post_ptr,
        comb_ptr,
        num_tokens,
        k_total,
        norm_eps,
        eps,
        SPLIT,
        SPLIT_BLOCK,
        N,
        ROWS,
        BLOCK_T,
        ITERS,
        False,
    )


# ---------------------------------------------------------------- launchers


def _mix_config(num_tokens: int, dim: int, block_t: int | None, split: int | None) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_D, tiles per split, splits): split D until about two programs per SM.

    BLOCK_D is 16: every warp holds the whole [BLOCK_D, ROWS·N] fn operand of its MMAs in registers
    (twice: hi and lo), and wider D tiles spill with the expand fused in (sm_90a, ptxas)."""
    fixed = invariance.active()  # tiles and splits from D only (kernels/invariance.py)
    if block_t is None:
        block_t = invariance.BLOCK_M if fixed else 16 if num_tokens <= 16 else 32 if num_tokens <= 512 else 64
    block_d = 16
    num_tiles = triton.cdiv(dim, block_d)
    if split is None and fixed:
        split = min(num_tiles, invariance.MIX_SPLITS)
    if split is None:  # a power of two from T's power-of-two bucket: TILES and SPLIT are constexprs
        tiles_t = triton.cdiv(triton.next_power_of_2(num_tokens), block_t)
        split = min(num_tiles, triton.next_power_of_2(triton.cdiv(2 * NUM_SMS_H200, tiles_t)))
    per = triton.cdiv(num_tiles, split)
    return block_t, block_d, per, triton.cdiv(num_tiles, per)


def _launch_mix(
    h: torch.Tensor,
    y: torch.Tensor | None,
    mix_in: Mix | None,
    w: MixWeights,
    collapse_pre: torch.Tensor | None,
    block_t: int | None,
    split: int | None,
    num_warps: int | None,
    one_launch: bool,
) -> MixResult:
    num_tokens, n, dim = h.shape
    if w.fn_split.shape != (2, n * (n + 2), n * dim) or w.base.shape != (n * (n + 2),) or w.scale.shape != (3,):
        raise ValueError(
            f"mix weights {tuple(w.fn_split.shape)}, {tuple(w.base.shape)}, {tuple(w.scale.shape)} "
            f"do not fit n={n}, D={dim}"
        )
    if n & (n - 1):
        raise ValueError(f"hc_mult must be a power of two here, got {n}")
    rows = triton.next_power_of_2(n + 2)
    dev = h.device
    pre, post = (torch.empty(num_tokens, n, device=dev) for _ in range(2))
    comb = torch.empty(num_tokens, n, n, device=dev)
    expanding = y is not None
    h_out = torch.empty(num_tokens, n, dim, device=dev, dtype=y.dtype) if expanding else h
    mixed = h_out
    x = torch.empty(num_tokens, dim, device=dev, dtype=mixed.dtype) if collapse_pre is not None else None
    if num_tokens == 0:
        return MixResult(Mix(pre, post, comb), h_out, x)
    block_t, block_d, per, num_splits = _mix_config(num_tokens, dim, block_t, split)
    part = torch.empty(num_splits if num_splits > 1 else 0, num_tokens, rows * n, device=dev)
    sq = torch.empty(num_splits if num_splits > 1 else 0, num_tokens, device=dev)
    dummy = pre  # stands in for pointers a variant does not read
    grid = (triton.cdiv(num_tokens, block_t), num_splits)
    num_warps = num_warps or (8 if block_t >= 64 or (block_t == 32 and expanding) else 4)
    # One token per finishing program (T programs: 16-token tiles gave T = 256 only 16, too few for the SMs);
    # about 4K partial values per load: [SPLIT_BLOCK, 1, ROWS·N] (32 per thread at 4 warps).
    split_block = min(triton.next_power_of_2(num_splits), max(1, 4096 // (rows * n)))
    # In the mix launch (its last program, one token at a time) up to FINISH_IN_MIX_MAX_TOKENS tokens, at the
    # finishing kernel's 4 warps (the same shapes and warps: the same sums); else a launch of its own.
    finish_here = num_splits > 1 and num_tokens <= FINISH_IN_MIX_MAX_TOKENS and num_warps == 4 and one_launch
    ticket = tickets("mhc_mix", dev, grid[0]) if finish_here else dummy
    _mix_kernel[grid](
        h,
        y if expanding else dummy,
        mix_in.post.contiguous() if expanding else dummy,
        mix_in.comb.contiguous() if expanding else dummy,
        h_out,
        collapse_pre.reshape(num_tokens, n).float().contiguous() if x is not None else dummy,
        x if x is not None else dummy,
        w.fn_split,
        w.base,
        w.scale,
        part,
        sq,
        pre,
        post,
        comb,
        ticket,
        num_tokens,
        dim,
        h.stride(0),
        h.stride(1),
        y.stride(0) if expanding else 0,
        w.norm_eps,
        w.eps,
        N=n,
        TILES=per,
        ROWS=rows,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
        SPLIT=num_splits,
        EXPAND=expanding,
        COLLAPSE=x is not None,
        ITERS=w.iters,
        V_EXACT=mixed.dtype in (torch.bfloat16, torch.float16),
        FINISH=finish_here,
        SPLIT_BLOCK=split_block,
        num_warps=num_warps,
        num_stages=2,
    )
    if num_splits > 1 and not finish_here:
        finish_t = 1
        _mix_finish_kernel[(triton.cdiv(num_tokens, finish_t),)](
            part,
            sq,
            w.base,
            w.scale,
            pre,
            post,
            comb,
            num_tokens,
            n * dim,
            w.norm_eps,
            w.eps,
            SPLIT=num_splits,
            SPLIT_BLOCK=split_block,
            N=n,
            ROWS=rows,
            BLOCK_T=finish_t,
            ITERS=w.iters,
            num_warps=4,
        )
    return MixResult(Mix(pre, post, comb), h_out, x)


def mhc_mix(
    h: torch.Tensor,
    w: MixWeights,
    collapse_pre: torch.Tensor | None = None,
    *,
    block_t: int | None = None,
    split: int | None = None,
    num_warps: int | None = None,
    one_launch: bool = True,
) -> MixResult:
    """Mix(h) for one site, h [..., n, D]; with ``collapse_pre`` [..., n] also Collapse(h, collapse_pre).

    Mix fields come back as [T, n] / [T, n, n] fp32 (T = the leading dims flattened); ``x`` [T, D].
    ``one_launch`` False: the split partials always finished by ``_mix_finish_kernel`` (kept to test against)."""
    return _launch_mix(_streams(h), None, None, w, collapse_pre, block_t, split, num_warps, one_launch)


def mhc_expand_mix(
    y: torch.Tensor,
    h: torch.Tensor,
    mix: Mix,
    w: MixWeights,
    collapse_pre: torch.Tensor | None = None,
    *,
    block_t: int | None = None,
    split: int | None = None,
    num_warps: int | None = None,
    one_launch: bool = True,
) -> MixResult:
    """h' = Expand(y, h, mix) (y [..., D], h [..., n, D], h' in y.dtype), then Mix(h') with ``w`` and,
    with ``collapse_pre``, Collapse(h', collapse_pre): one read of y and h, one write of h'."""
    h3 = _streams(h)
    num_tokens, n, _ = h3.shape
    mix_in = Mix(mix.pre, mix.post.reshape(num_tokens, n).float(), mix.comb.reshape(num_tokens, n, n).float())
    return _launch_mix(h3, _rows(y), mix_in, w, collapse_pre, block_t, split, num_warps, one_launch)
