"""FP8 grouped GEMM for MoE decode, masked layout, graph-safe; gate/up fused with the clamped SwiGLU.

Formats (``kernels/reference.py``): weights e4m3 [E, N_w, K] with one fp32 power-of-two scale per
128×128 block (``kernels/fp8_weights.py`` converts the checkpoint's MXFP4 experts at load time);
activations e4m3 per token and per 128 channels with a power-of-two scale, either handed in
pre-quantised (``quant_fp8.quantize_act``, or the SwiGLU epilogue's FP8 output: the default path,
fastest on the H200 at every batch) or quantised inside the K loop from bf16/fp32. The gate/up
GEMM gathers token rows through the slot → token map, so no dispatch copy of the tokens exists.

Masked layout: expert e owns slots [e, 0:counts[e]) of a fixed [E, capacity] grid. Every shape is
fixed per batch size and the per-expert counts live in a device tensor, so a step can be captured
in a CUDA graph: the host never reads a count. The grid is persistent (a fixed number of programs);
program p takes work items p, p + P, … of the ``num_active · N/BLOCK_N`` items (active expert,
N tile), so experts without tokens cost nothing, not even an empty program.

Each work item reads its [BLOCK_N, K] weight slab once per BLOCK_M tokens (once, when the expert's
count ≤ BLOCK_M), computes outᵀ = W · quant(A)ᵀ (weights on the MMA's wide M side, tokens on its
narrow N side: decode has few tokens per expert), and applies scale_w · scale_a per 128-deep step
in fp32. With SWIGLU it also reads the matching up-projection slab (rows N..2N of W) and writes
silu(min(g, L)) · clamp(u, −L, L) · route_w in bf16, or in e4m3 + scales (a 128-wide N tile is
one scale group of each token); otherwise it writes the product in bf16 (or fp32, for tests).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import invariance, moe_configs
from kernels.device import num_sms
from kernels.fp8_splitk import MAX_TOKENS as SPLITK_MAX_TOKENS  # noqa: F401 - re-exported: KernelLinear
from kernels.fp8_splitk import fp8_linear_splitk, worth_splitting  # noqa: F401 - re-exported: KernelLinear
from kernels.moe_combine import moe_combine
from kernels.moe_splitk import moe_experts_splitk, worth_splitting_experts  # noqa: F401 - re-exported: KernelMoE
from kernels.quant_fp8 import (
    IN_GEMM_MAX_ROWS,
    Activations,  # noqa: F401 - re-exported: the kernels bench imports it here
    _quantize_rows,
    quantize_act,
)
from kernels.reference import GROUP

BLOCK_K = GROUP  # one weight scale and one activation scale per K step


@triton.jit(do_not_specialize=("capacity", "m_split", "out_stride_e"))
def _moe_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    row_ids_ptr,
    route_w_ptr,
    counts_ptr,
    active_ptr,
    num_active_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    out_scale_ptr,
    capacity,
    a_row_stride,
    swiglu_limit,
    m_split,
    out_stride_e,
    out_stride_m,
    N_OUT: tl.constexpr,
    K: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    A_FP8: tl.constexpr,
    OUT_FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_M: tl.constexpr,
):
    NUM_N_TILES: tl.constexpr = N_OUT // BLOCK_N
    N_W: tl.constexpr = 2 * N_OUT if SWIGLU else N_OUT
    K_BLOCKS: tl.constexpr = K // BLOCK_K
    SCALE_ROWS: tl.constexpr = N_W // BLOCK_K  # scale-block rows per expert
    UP_SCALE_OFFSET: tl.constexpr = (N_OUT // BLOCK_K) * K_BLOCKS
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    # A work item is (active expert, N tile, M part): part j takes the expert's M tiles j, j + m_split, …
    # Parts of one slab are consecutive items, so programs running at once share its weights in L2.
    # SPLIT_M False compiles the kernel without the split arithmetic (decode and MoE: m_split is 1).
    if SPLIT_M:
        num_work = tl.load(num_active_ptr) * NUM_N_TILES * m_split
        m_step = BLOCK_M * m_split
    else:
        num_work = tl.load(num_active_ptr) * NUM_N_TILES
        m_step = BLOCK_M
    # while loops over device-read bounds (the interpreter's range() wants host ints).
    work = tl.program_id(0)
    while work < num_work:
        if SPLIT_M:
            slab = work // m_split
            m0 = (work % m_split) * BLOCK_M
        else:
            slab = work
            m0 = tl.full([], 0, tl.int32)
        expert = tl.load(active_ptr + slab // NUM_N_TILES).to(tl.int64)
        n0 = (slab % NUM_N_TILES) * BLOCK_N
        count = tl.load(counts_ptr + expert)
        w_ptrs = w_ptr + (expert * N_W + n0 + offs_n)[:, None] * K + offs_k[None, :]
        scale_ptr = w_scale_ptr + (expert * SCALE_ROWS + n0 // BLOCK_K) * K_BLOCKS
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
            for kb in range(K_BLOCKS):
                if A_FP8:  # quantised upstream: e4m3 rows with one fp32 scale per 128 channels
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
                # Row (expert, m) at expert · out_stride_e + m · out_stride_m: slots · N_OUT for a dense
                # [E, cap, N_out] output, or a transposed view's rows (GroupedKernelLinear's [T, G, R]).
                out_rows = expert * out_stride_e + offs_m.to(tl.int64) * out_stride_m
                out_ptrs = out_ptr + out_rows[None, :] + (n0 + offs_n)[:, None]
                tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
            m0 += m_step
        work += tl.num_programs(0)


@functools.cache
def _num_programs(device: torch.device, num_work_max: int, programs_per_sm: int) -> int:
    return max(1, min(num_work_max, num_sms(device, off_gpu=4) * programs_per_sm))


def default_block_m(expected_m: float) -> int:
    """Tokens per MMA tile: covers ~1.5× the mean tokens per expert (one weight pass for most)."""
    return max(16, min(64, triton.next_power_of_2(int(1.5 * expected_m + 0.999))))


DEFAULT_NUM_STAGES = 3
DEFAULT_PROGRAMS_PER_SM = 2


def default_num_warps(block_n: int, block_m: int, swiglu: bool) -> int:
    """4–8 warps: at most 64 fp32 accumulators per thread (BLOCK_M 64 with SwiGLU spilled at 4 warps)."""
    return min(8, max(4, block_n * block_m * (2 if swiglu else 1) // (32 * 64)))


def default_m_split(num_slabs: int, num_m_tiles: int, num_programs: int) -> int:
    """M parts per (expert, N tile) slab: 1 when the slabs alone fill the programs (MoE, decode: the
    kernel as it was), else enough to fill them. A one-expert linear at prefill has only N/128 slabs
    (wq_a 10, wkv 4 for v41: 10 of 132 SMs busy with 256 M tiles each at 4K tokens)."""
    if num_slabs >= num_programs or num_m_tiles <= 1:
        return 1
    return min(num_m_tiles, triton.cdiv(num_programs, num_slabs))


def moe_grouped_gemm(
    a: Activations,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    meta: dict[str, torch.Tensor],
    *,
    gather: bool,
    swiglu_limit: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int | None = None,
    block_n: int = 128,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs_per_sm: int | None = None,
    m_split: int | None = None,
    out: Activations | None = None,
) -> Activations:
    """Launch the masked grouped GEMM; returns [E, cap, N_out] in ``out_dtype`` (bf16 or fp32), or
    with ``out_dtype=torch.float8_e4m3fn`` (SwiGLU only) the pair (e4m3 values, fp32 scales
    [E, cap, N_out/128]) that the down projection takes as its pre-quantised input.

    Slots ≥ counts[e] are not written. a: [T, K] rows picked through ``meta["row_ids"]`` when
    ``gather``, else [E, cap, K] (a pair for pre-quantised input, scales [..., K/128]); w e4m3
    [E, N_w, K]; w_scale fp32 [E, N_w/128, K/128]; meta from ``reference.route_metadata``.
    With ``swiglu_limit`` the gate/up rows are fused (N_out = N_w/2) and ``meta["route_w"]`` applied.
    Matches ``reference.moe_grouped_gemm`` on the written slots.

    ``num_warps``, ``num_stages`` and ``programs_per_sm``: where all three are None, the device's measured
    config for this shape and token count (``kernels/moe_configs.py``), else 4–8 warps (by the accumulators),
    3 stages and 2 programs per SM; none of them changes the result's bits.

    ``m_split`` (None: ``default_m_split``) splits each expert's token tiles over that many work items;
    every output tile is still computed by one program in the same K order, so the result does not
    depend on it. ``out`` (None: allocated here) is where the output goes, of the shape and dtype returned
    (the pair for e4m3 output), e.g. a slice of a bigger stack (``moe_experts``' shared expert), or for bf16/fp32
    any view whose channels are dense (``GroupedKernelLinear``'s [T, G, R] buffer seen as [G, T, R]).
    """
    a_values, a_scale = a if isinstance(a, tuple) else (a, None)
    a_fp8 = a_scale is not None
    out_fp8 = out_dtype == torch.float8_e4m3fn
    num_experts, n_w, k = w.shape
    capacity = meta["row_ids"].shape[1]
    n_out = n_w // 2 if swiglu_limit is not None else n_w
    if w.dtype != torch.float8_e4m3fn or w_scale.dtype != torch.float32:
        raise TypeError(f"expected e4m3 weights and fp32 scales, got {w.dtype}, {w_scale.dtype}")
    if k % BLOCK_K or n_out % GROUP or GROUP % block_n:
        raise ValueError(f"K={k} and N={n_out} must be multiples of {GROUP}; block_n must divide {GROUP}")
    if w_scale.shape != (num_experts, n_w // GROUP, k // GROUP):
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} != {(num_experts, n_w // GROUP, k // GROUP)}")
    if out_fp8 and (swiglu_limit is None or block_n != GROUP):
        raise ValueError(f"FP8 output is the SwiGLU epilogue's, with block_n = {GROUP}")
    rows_shape = (a_values.shape[0], k) if gather else (num_experts, capacity, k)
    if a_values.shape != rows_shape or (gather and a_values.ndim != 2):
        raise ValueError(f"activations must be {rows_shape}, got {tuple(a_values.shape)}")
    scale_shape = (*rows_shape[:-1], k // GROUP)
    if a_scale is not None and (a_values.dtype != torch.float8_e4m3fn or a_scale.shape != scale_shape):
        raise ValueError("pre-quantised activations need e4m3 values and fp32 scales [..., K/128]")
    # Rows are addressed as row · stride: every operand must be dense.
    a_values = a_values.contiguous()
    a_scale = a_values if a_scale is None else a_scale.contiguous()  # unread without A_FP8
    if out is None:
        out = empty_output(num_experts, capacity, n_out, out_dtype, a_values.device)
    out_values, out_scale = out if isinstance(out, tuple) else (out, out)  # out_scale unread without OUT_FP8
    # bf16/fp32 output rows may sit at any row strides (channels dense); the e4m3 pair is dense.
    dense = out_values.is_contiguous() and out_scale.is_contiguous() if out_fp8 else out_values.stride(-1) == 1
    if (
        isinstance(out, tuple) != out_fp8
        or out_values.shape != (num_experts, capacity, n_out)
        or out_values.dtype != out_dtype
        or not dense
    ):
        raise ValueError(
            f"out must be {out_dtype} [{num_experts}, {capacity}, {n_out}] (dense channels; the "
            f"e4m3 pair dense), got {out_values.dtype} {tuple(out_values.shape)}"
        )
    if block_m is None and invariance.active():
        block_m = invariance.BLOCK_M  # not the load per expert (kernels/invariance.py)
    if block_m is None:
        block_m = default_block_m(meta["slot_of"].numel() / num_experts)
    if num_warps is None and num_stages is None and programs_per_sm is None and block_n == GROUP:
        key = moe_configs.shape_key(
            num_experts, n_w, k, swiglu=swiglu_limit is not None, a_fp8=a_fp8, out_dtype=out_dtype
        )
        # T's power of two: the configs a step can take are the table's rows nearest those (docs/kernel-notes.md)
        measured = moe_configs.lookup(a_values.device, key, triton.next_power_of_2(meta["slot_of"].shape[0]))
        num_warps, num_stages, programs_per_sm = (measured.get(f) for f in moe_configs.FIELDS)
    num_warps = default_num_warps(block_n, block_m, swiglu_limit is not None) if num_warps is None else num_warps
    num_stages = DEFAULT_NUM_STAGES if num_stages is None else num_stages
    programs_per_sm = DEFAULT_PROGRAMS_PER_SM if programs_per_sm is None else programs_per_sm
    num_work_max = num_experts * (n_out // block_n)
    if m_split is None:
        m_split = default_m_split(
            num_work_max, triton.cdiv(capacity, block_m), num_sms(a_values.device, off_gpu=4) * programs_per_sm
        )
    if m_split < 1:
        raise ValueError(f"m_split must be ≥ 1, got {m_split}")
    grid = (_num_programs(a_values.device, num_work_max * m_split, programs_per_sm),)
    _moe_gemm_kernel[grid](
        a_values,
        a_scale,
        meta["row_ids"],
        meta["route_w"],
        meta["counts"],
        meta["active"],
        meta["num_active"],
        w,
        w_scale,
        out_values,
        out_scale,
        capacity,
        k,
        float(swiglu_limit or 0.0),
        m_split,
        out_values.stride(0),
        out_values.stride(1),
        N_OUT=n_out,
        K=k,
        GATHER=gather,
        SWIGLU=swiglu_limit is not None,
        A_FP8=a_fp8,
        OUT_FP8=out_fp8,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        SPLIT_M=m_split > 1,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def empty_output(
    num_experts: int, capacity: int, n_out: int, out_dtype: torch.dtype, device: torch.device
) -> Activations:
    """An unwritten [E, cap, N_out] output of ``moe_grouped_gemm``: ``out_dtype`` values, or for e4m3 the pair
    (values, fp32 scales [E, cap, N_out/128])."""
    values = torch.empty(num_experts, capacity, n_out, dtype=out_dtype, device=device)
    if out_dtype != torch.float8_e4m3fn:
        return values
    return values, torch.empty(num_experts, capacity, n_out // GROUP, dtype=torch.float32, device=device)


def moe_experts(
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
    shared_launch: bool | None = None,
    live: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """Routed experts of one layer: x [T, D] → fp32 [T, D]; gate/up+SwiGLU, down, then the combine
    (``live`` and ``width`` go to it: +0.0 in the rows outside ``live``, only the first ``width`` columns).

    ``prequantize``: quantise x once (``quant_fp8.quantize_act``; up to ``quant_fp8.IN_GEMM_MAX_ROWS`` rows
    the gate/up GEMM does it in its loop instead, the same bits without the launch) and hand h from the
    SwiGLU epilogue to the down GEMM as e4m3 + scales; otherwise both GEMMs quantise bf16 input in their
    loops. The combine is ``kernels.moe_combine`` (``shared_last``: the last column of ``slot_of`` is
    the shared expert, summed first).

    ``shared_last`` also says that the last stacked expert is the shared one, picked by every live row
    (``KernelMoE``'s layout). Where its rows span more than one M tile it gets its own launch of each GEMM
    (``shared_apart``): in the one launch it was the last work item of every N tile and walked all its M
    tiles serially while the routed experts held a tile or two each (a v41-s1 decode step of 256 rows:
    4 BLOCK_M-64 tiles against the routed experts' one), the launch's tail. Both launches write one
    output stack with the same tile size, so every slot's bits are those of the one launch.
    ``shared_launch`` (with ``shared_last``) overrides that choice (None: ``shared_apart``'s).
    """
    num_stacked = w13.shape[0]
    block_m = invariance.BLOCK_M if invariance.active() else default_block_m(meta["slot_of"].numel() / num_stacked)
    h_dtype = torch.float8_e4m3fn if prequantize else torch.bfloat16
    a = quantize_act(x) if prequantize and x.shape[0] > IN_GEMM_MAX_ROWS else x
    if shared_launch is None:
        shared_launch = shared_apart(meta["row_ids"].shape[1], block_m)
    if not (shared_last and shared_launch):
        h = moe_grouped_gemm(
            a, w13, w13_scale, meta, gather=True, swiglu_limit=swiglu_limit, out_dtype=h_dtype, block_m=block_m
        )
        y = moe_grouped_gemm(h, w2, w2_scale, meta, gather=False, block_m=block_m)
        assert isinstance(y, torch.Tensor)  # bf16 output: not the FP8 pair
        return moe_combine(y, meta["slot_of"], shared_last, live=live, width=width)
    routed, shared = split_shared(meta)
    capacity = meta["row_ids"].shape[1]
    h = empty_output(num_stacked, capacity, w13.shape[1] // 2, h_dtype, x.device)
    y = empty_output(num_stacked, capacity, w2.shape[1], torch.bfloat16, x.device)
    for part, experts in ((routed, slice(0, -1)), (shared, slice(-1, None))):
        h_part = _experts_of(h, experts)
        moe_grouped_gemm(
            a,
            w13[experts],
            w13_scale[experts],
            part,
            gather=True,
            swiglu_limit=swiglu_limit,
            out_dtype=h_dtype,
            block_m=block_m,
            out=h_part,
        )
        moe_grouped_gemm(
            h_part, w2[experts], w2_scale[experts], part, gather=False, block_m=block_m, out=_experts_of(y, experts)
        )
    assert isinstance(y, torch.Tensor)
    return moe_combine(y, meta["slot_of"], shared_last, live=live, width=width)


def shared_apart(capacity: int, block_m: int) -> bool:
    """Whether ``moe_experts`` gives the shared expert (``capacity`` rows at most) its own launches: when they
    span more than one M tile. A lone tile is a routed expert's share of the work, and its own launch of
    N/128 programs would only add a launch (decode at batch 1: 36 programs reading 24 MB)."""
    return capacity > block_m


def split_shared(meta: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The routed experts' and the shared expert's launch metadata, for weight stacks sliced to [:-1] and [-1:].

    Routed: the same layout, one active expert fewer. Experts with rows are listed first in id order and the
    shared expert, the last id, has rows when any row is live, so it is the last active one; when no row is
    live, no expert has rows and −1 active experts is no work as 0 is. Shared: the layout's last expert
    alone (its counts, row ids, routing weights), one active expert, index 0 of the sliced stack."""
    one = _one_active(meta["counts"].device)
    routed = dict(meta, num_active=meta["num_active"] - 1)
    shared = dict(
        meta,
        counts=meta["counts"][-1:],
        row_ids=meta["row_ids"][-1:],
        route_w=meta["route_w"][-1:],
        active=one[:1],
        num_active=one[1:],
    )
    return routed, shared


def _experts_of(out: Activations, experts: slice) -> Activations:
    """The stacked experts ``experts`` of an output (both halves of the e4m3 pair): views, dense."""
    return (out[0][experts], out[1][experts]) if isinstance(out, tuple) else out[experts]


_ONE_ACTIVE: dict[torch.device, torch.Tensor] = {}


def _one_active(device: torch.device) -> torch.Tensor:
    """int32 [0, 1]: ``active`` ([:1]) and ``num_active`` ([1:]) of a launch over one expert. Kept per device
    when made outside a CUDA graph capture; one made during a capture holds its values only in replays, so it
    is made anew there (one arange in the graph)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.arange(2, dtype=torch.int32, device=device)
    if device not in _ONE_ACTIVE:
        _ONE_ACTIVE[device] = torch.arange(2, dtype=torch.int32, device=device)
    return _ONE_ACTIVE[device]
