"""Split-K FP8 grouped GEMM for MoE decode: ``moe_grouped_gemm``'s masked layout and contract, K split over programs.

At decode's few tokens the one-pass grouped GEMM (``kernels/moe_grouped_gemm.py``) has one work item per
(active expert, 128-wide N tile), each streaming all of K: v41-s1 at batch 1 activates 7 experts (top-6 and
the shared one), 7 · 18 = 126 gate/up items and 7 · 40 = 280 down items on 132 SMs, each a long serial K
loop, far from HBM's bandwidth. Here a work item is (active expert, N tile, split): it streams K blocks
[split · B, (split + 1) · B) and writes an fp32 partial product per slot. The last of a tile's items to
finish, chosen by an acquire-release ticket counter per (expert, N tile) as in ``kernels/fp8_splitk.py``,
adds the tile's partials in split order and applies the epilogue: the clamped SwiGLU with the routing
weights (bf16, or e4m3 + scales) or the plain product (bf16 or fp32). Only *who* sums depends on timing,
never the order, so the result is the same bits on every run; the last item puts the counter back to 0,
so counters are 0 between launches and graph replays (launches on a device run one at a time, on one
compute stream, as the worker's do).

Formats, layout and arguments are ``moe_grouped_gemm``'s (weights e4m3 [E, N_w, K] with 128×128 pow2 block
scales; activations e4m3 with 1×128 scales or quantised in the K loop, a K block at a time, so a split
quantises exactly what the one pass does; slot → token gather; ``counts``, ``active`` and ``num_active`` read
on the device only, so a launch is graph-safe). Work items run on a persistent grid over the
``num_active · N/128 · splits`` items, so experts without tokens cost nothing. Each item's per-block
products and scales are the one pass's; only the grouping of the K/128 block sums differs (fp32 rounding).

The split count is a function of N, K, the routing width (picks per row, a model constant) and the SM
count, never of the token count, so a row's result does not depend on its batch. Tokens per expert are
the MMA's narrow side: one ``BLOCK_M`` = 16 tile at decode (``worth_splitting_experts``); more are walked
in 16-row tiles, each re-reading the item's weight slab.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import invariance
from kernels.device import num_sms
from kernels.moe_combine import moe_combine
from kernels.quant_fp8 import Activations, _quantize_rows, quantize_act
from kernels.reference import GROUP

BLOCK_M = 16
"""Tokens per MMA tile (the narrow side)."""
BLOCK_N = GROUP
BLOCK_K = GROUP  # one weight scale and one activation scale per K step
MAX_TOKENS = BLOCK_M
"""Slots per expert (the layout's capacity) up to which ``worth_splitting_experts`` picks this path: one M tile."""
ITEMS_PER_SM = 4
"""Work items aimed at per SM at the routing width's active experts (fp8_splitk's figure)."""
PROGRAMS_PER_SM = {False: 3, True: 2}
"""Persistent programs per SM, plain and with SwiGLU: as many as the registers hold at once. ptxas for sm_90a
(scripts/dev/compile_sm90.py, 4 warps, v41-s1 shapes): the down GEMM with e4m3 input uses 159 registers a thread
(3 programs of 128 threads in 64K), the SwiGLU GEMM 255 (2), as the one pass does (146 and 255)."""


@triton.jit(do_not_specialize=("capacity", "part_split_stride"))
def _moe_splitk_kernel(
    a_ptr,
    a_scale_ptr,
    row_ids_ptr,
    route_w_ptr,
    counts_ptr,
    active_ptr,
    num_active_ptr,
    w_ptr,
    w_scale_ptr,
    part_ptr,
    out_ptr,
    out_scale_ptr,
    ticket_ptr,
    capacity,
    a_row_stride,
    part_split_stride,
    swiglu_limit,
    N_OUT: tl.constexpr,
    K: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    A_FP8: tl.constexpr,
    OUT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """part [SPLIT, E·cap, N_w] fp32: split s's product of each written slot over its K blocks (gate in
    columns [0, N_OUT), up in [N_OUT, 2·N_OUT) with SWIGLU); ticket [E · N_OUT/BLOCK_N] int32, 0 on entry."""
    NUM_N_TILES: tl.constexpr = N_OUT // BLOCK_N
    N_W: tl.constexpr = 2 * N_OUT if SWIGLU else N_OUT
    K_BLOCKS: tl.constexpr = K // BLOCK_K
    SCALE_ROWS: tl.constexpr = N_W // BLOCK_K  # scale-block rows per expert
    UP_SCALE_OFFSET: tl.constexpr = (N_OUT // BLOCK_K) * K_BLOCKS
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    split_stride = part_split_stride.to(tl.int64)  # s · stride passes 2^31 at 40 splits of a 49 × 256-slot grid
    # Item (active expert, N tile, split); a tile's splits are consecutive items, so they finish close
    # together and the last one reads the partials while they are still in L2.
    num_work = tl.load(num_active_ptr) * NUM_N_TILES * SPLIT
    work = tl.program_id(0)
    while work < num_work:  # while loops over device-read bounds (the interpreter's range() wants host ints)
        slab = work // SPLIT
        split = work % SPLIT
        expert = tl.load(active_ptr + slab // NUM_N_TILES).to(tl.int64)
        tile = slab % NUM_N_TILES
        n0 = tile * BLOCK_N
        count = tl.load(counts_ptr + expert)
        w_ptrs = w_ptr + (expert * N_W + n0 + offs_n)[:, None] * K + offs_k[None, :]
        scale_ptr = w_scale_ptr + (expert * SCALE_ROWS + n0 // BLOCK_K) * K_BLOCKS
        part_at = part_ptr + split * split_stride + (n0 + offs_n)[:, None]
        kb0 = split * BLOCKS_PER_SPLIT
        m0 = tl.full([], 0, tl.int32)
        while m0 < count:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            m_ok = offs_m < count
            slots = expert * capacity + offs_m
            if GATHER:
                rows = tl.load(row_ids_ptr + slots, mask=m_ok, other=0).to(tl.int64)
            else:
                rows = slots
            a_ptrs = a_ptr + rows[:, None] * a_row_stride + offs_k[None, :]
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for i in range(BLOCKS_PER_SPLIT):  # the one pass's K step, on this split's blocks
                kb = kb0 + i
                if A_FP8:
                    a_q = tl.load(a_ptrs + kb * BLOCK_K, mask=m_ok[:, None], other=0.0)
                    a_scale = tl.load(a_scale_ptr + rows * K_BLOCKS + kb, mask=m_ok, other=1.0)
                else:
                    a = tl.load(a_ptrs + kb * BLOCK_K, mask=m_ok[:, None], other=0.0).to(tl.float32)
                    a_q, a_scale = _quantize_rows(a)  # padded rows are 0 → code 0, any scale
                a_t = tl.trans(a_q)
                w = tl.load(w_ptrs + kb * BLOCK_K)
                acc += tl.dot(w, a_t) * (tl.load(scale_ptr + kb) * a_scale)[None, :]
                if SWIGLU:
                    w_up = tl.load(w_ptrs + N_OUT * K + kb * BLOCK_K)
                    s_up = tl.load(scale_ptr + UP_SCALE_OFFSET + kb)
                    acc_up += tl.dot(w_up, a_t) * (s_up * a_scale)[None, :]
            at = part_at + slots[None, :] * N_W
            tl.store(at, acc, mask=m_ok[None, :])
            if SWIGLU:
                tl.store(at + N_OUT, acc_up, mask=m_ok[None, :])
            m0 += BLOCK_M
        # Every thread's partials are stored before the ticket is taken (the barrier), and released with it;
        # the last item's acquire makes all SPLIT partials visible to it (read from L2: ".cg").
        tl.debug_barrier()
        ticket_at = ticket_ptr + expert * NUM_N_TILES + tile
        ticket = tl.atomic_add(ticket_at, 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            m0 = tl.full([], 0, tl.int32)
            while m0 < count:
                offs_m = m0 + tl.arange(0, BLOCK_M)
                m_ok = offs_m < count
                slots = expert * capacity + offs_m
                at = part_ptr + slots[None, :] * N_W + (n0 + offs_n)[:, None]
                acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for s in tl.static_range(SPLIT):  # split order: the sum's order never depends on timing
                    acc += tl.load(at + s * split_stride, mask=m_ok[None, :], other=0.0, cache_modifier=".cg")
                    if SWIGLU:
                        acc_up += tl.load(
                            at + s * split_stride + N_OUT, mask=m_ok[None, :], other=0.0, cache_modifier=".cg"
                        )
                # The one pass's epilogue (kernels/moe_grouped_gemm.py), on the summed tile.
                if SWIGLU:
                    gate = tl.minimum(acc, swiglu_limit)
                    up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
                    route_w = tl.load(route_w_ptr + slots, mask=m_ok, other=0.0)
                    acc = gate / (1.0 + tl.exp(-gate)) * up * route_w[None, :]
                if OUT_FP8:  # BLOCK_N == 128: this tile is exactly one scale group of each token's row
                    out_q, out_scale = _quantize_rows(tl.trans(acc))
                    out_ptrs = out_ptr + slots[:, None] * N_OUT + (n0 + offs_n)[None, :]
                    tl.store(out_ptrs, out_q, mask=m_ok[:, None])
                    tl.store(out_scale_ptr + slots * (N_OUT // BLOCK_K) + n0 // BLOCK_K, out_scale, mask=m_ok)
                else:
                    out_ptrs = out_ptr + slots[None, :] * N_OUT + (n0 + offs_n)[:, None]
                    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
                m0 += BLOCK_M
            tl.store(ticket_at, 0)  # 0 again for the next launch or graph replay
        work += tl.num_programs(0)


_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}
"""Per (device, experts · N tiles): the ticket counters, zero between launches. Never freed: a captured graph
reads them by address."""


def tickets(device: torch.device, size: int) -> torch.Tensor:
    """The int32 [size] ticket counters of launches with ``size`` (expert, N tile) pairs on ``device``."""
    key = (torch.device(device), size)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(size, dtype=torch.int32, device=device)
    return _TICKETS[key]


def num_splits(n_out: int, k: int, picks_per_row: int, device: torch.device) -> tuple[int, int]:
    """(splits, K blocks per split) of an [N_out, K] expert GEMM whose rows pick ``picks_per_row`` experts
    (slot_of's width; a batch-1 step activates that many): the fewest blocks per split that divide K/128 and
    give at most ``ITEMS_PER_SM`` items per SM at that many active experts, never 2 or 3 blocks per split
    (fp8_splitk.py: those loops unroll and spill). v41-s1 on 132 SMs, 7 picks: gate/up 5 × 8, down 2 × 9."""
    n_tiles, k_blocks = n_out // BLOCK_N, k // BLOCK_K
    most = max(1, triton.cdiv(ITEMS_PER_SM * num_sms(device, off_gpu=132), n_tiles * picks_per_row))
    per = next(p for p in range(1, k_blocks + 1) if k_blocks % p == 0 and p not in (2, 3) and k_blocks // p <= most)
    return k_blocks // per, per


def moe_grouped_gemm_splitk(
    a: Activations,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    meta: dict[str, torch.Tensor],
    *,
    gather: bool,
    swiglu_limit: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    splits: int | None = None,
    partials: torch.Tensor | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
) -> Activations:
    """``moe_grouped_gemm.moe_grouped_gemm``'s result (its arguments, formats and written slots) with K split:
    [E, cap, N_out] in ``out_dtype`` (bf16 or fp32), or for e4m3 (SwiGLU only) the pair (e4m3 values, fp32
    scales [E, cap, N_out/128]). Slots ≥ counts[e] are not written.

    ``splits`` (None: ``num_splits``'s) must divide K/128. ``partials`` (None: allocated here) is the fp32
    [splits, E·cap, N_w] scratch the partial products go to; a caller passes one to read them back (tests).
    """
    a_values, a_scale = a if isinstance(a, tuple) else (a, None)
    a_fp8, out_fp8 = a_scale is not None, out_dtype == torch.float8_e4m3fn
    num_experts, n_w, k = w.shape
    capacity = meta["row_ids"].shape[1]
    n_out = n_w // 2 if swiglu_limit is not None else n_w
    if w.dtype != torch.float8_e4m3fn or w_scale.dtype != torch.float32:
        raise TypeError(f"expected e4m3 weights and fp32 scales, got {w.dtype}, {w_scale.dtype}")
    if k % BLOCK_K or n_out % BLOCK_N:
        raise ValueError(f"K={k} and N={n_out} must be multiples of {GROUP}")
    if w_scale.shape != (num_experts, n_w // GROUP, k // GROUP):
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} != {(num_experts, n_w // GROUP, k // GROUP)}")
    if out_fp8 and swiglu_limit is None:
        raise ValueError("FP8 output is the SwiGLU epilogue's")
    if out_dtype not in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        raise ValueError(f"out_dtype must be bf16, fp32 or e4m3, got {out_dtype}")
    rows_shape = (a_values.shape[0], k) if gather else (num_experts, capacity, k)
    if a_values.shape != rows_shape or (gather and a_values.ndim != 2):
        raise ValueError(f"activations must be {rows_shape}, got {tuple(a_values.shape)}")
    scale_shape = (*rows_shape[:-1], k // GROUP)
    if a_scale is not None and (a_values.dtype != torch.float8_e4m3fn or a_scale.shape != scale_shape):
        raise ValueError("pre-quantised activations need e4m3 values and fp32 scales [..., K/128]")
    k_blocks = k // BLOCK_K
    if splits is None:
        splits, per = num_splits(n_out, k, meta["slot_of"].shape[1], a_values.device)
    elif splits < 1 or k_blocks % splits:
        raise ValueError(f"splits must divide K/128 = {k_blocks}, got {splits}")
    else:
        per = k_blocks // splits
    a_values = a_values.contiguous()  # rows are addressed as row · stride: every operand dense
    a_scale = a_values if a_scale is None else a_scale.contiguous()  # unread without A_FP8
    device = a_values.device
    values = torch.empty(num_experts, capacity, n_out, dtype=out_dtype, device=device)
    out_scale = (
        torch.empty(num_experts, capacity, n_out // GROUP, dtype=torch.float32, device=device) if out_fp8 else values
    )  # unread without OUT_FP8
    part_shape = (splits, num_experts * capacity, n_w)
    if partials is None:
        partials = torch.empty(part_shape, dtype=torch.float32, device=device)
    elif partials.shape != part_shape or partials.dtype != torch.float32 or not partials.is_contiguous():
        raise ValueError(f"partials must be dense fp32 {part_shape}, got {partials.dtype} {tuple(partials.shape)}")
    num_tiles = n_out // BLOCK_N
    programs_per_sm = PROGRAMS_PER_SM[swiglu_limit is not None]
    grid = (max(1, min(num_experts * num_tiles * splits, programs_per_sm * num_sms(device, off_gpu=4))),)
    _moe_splitk_kernel[grid](
        a_values,
        a_scale,
        meta["row_ids"],
        meta["route_w"],
        meta["counts"],
        meta["active"],
        meta["num_active"],
        w,
        w_scale,
        partials,
        values,
        out_scale,
        tickets(device, num_experts * num_tiles),
        capacity,
        k,
        num_experts * capacity * n_w,
        float(swiglu_limit or 0.0),
        N_OUT=n_out,
        K=k,
        SPLIT=splits,
        BLOCKS_PER_SPLIT=per,
        GATHER=gather,
        SWIGLU=swiglu_limit is not None,
        A_FP8=a_fp8,
        OUT_FP8=out_fp8,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return (values, out_scale) if out_fp8 else values


def worth_splitting_experts(meta: dict[str, torch.Tensor], w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """Whether ``KernelMoE`` runs ``moe_experts_splitk`` instead of ``moe_experts``: outside the batch-invariant
    mode (which keeps the one pass at fixed tiles), at most ``MAX_TOKENS`` slots per expert (one M tile: decode),
    and K split at least in two for one of the layer's GEMMs. Shapes only: no host read of a device value."""
    if invariance.active() or meta["row_ids"].shape[1] > MAX_TOKENS:
        return False
    picks = meta["slot_of"].shape[1]
    return any(
        num_splits(n_out, k, picks, w13.device)[0] > 1
        for n_out, k in ((w13.shape[1] // 2, w13.shape[2]), (w2.shape[1], w2.shape[2]))
    )


def moe_experts_splitk(
    x: torch.Tensor,
    meta: dict[str, torch.Tensor],
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: float,
    *,
    prequantize: bool = True,
    shared_last: bool = False,
    live: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """``moe_grouped_gemm.moe_experts`` with both GEMMs split over K: x [T, D] → fp32 [T, D] (arguments as
    there; the shared expert, with ``shared_last``, stays in the one launch of each GEMM: at decode it has
    one M tile like the routed experts, so ``moe_experts``' separate shared launches have nothing to balance)."""
    a = quantize_act(x) if prequantize else x
    h = moe_grouped_gemm_splitk(
        a,
        w13,
        w13_scale,
        meta,
        gather=True,
        swiglu_limit=swiglu_limit,
        out_dtype=torch.float8_e4m3fn if prequantize else torch.bfloat16,
    )
    y = moe_grouped_gemm_splitk(h, w2, w2_scale, meta, gather=False)
    assert isinstance(y, torch.Tensor)  # bf16 output: not the FP8 pair
    return moe_combine(y, meta["slot_of"], shared_last, live=live, width=width)
