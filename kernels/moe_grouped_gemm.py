"""FP8 grouped GEMM for MoE decode, masked layout, graph-safe; gate/up fused with the clamped SwiGLU.

Formats (``kernels/reference.py``): weights e4m3 [E, N_w, K] with one fp32 power-of-two scale per
128×128 block (``kernels/fp8_weights.py`` converts the checkpoint's MXFP4 experts at load time);
activations bf16/fp32, quantised inside the kernel per token and per 128 channels to e4m3 with a
power-of-two scale, so no separate quantisation pass and no dispatch copy of the tokens exist.

Masked layout: expert e owns slots [e, 0:counts[e]) of a fixed [E, capacity] grid. Every shape is
fixed per batch size and the per-expert counts live in a device tensor, so a step can be captured
in a CUDA graph: the host never reads a count. The grid is persistent (a fixed number of programs);
program p takes work items p, p + P, … of the ``num_active · N/BLOCK_N`` items (active expert,
N tile), so experts without tokens cost nothing, not even an empty program.

Each work item reads its [BLOCK_N, K] weight slab once per BLOCK_M tokens (once, when the expert's
count ≤ BLOCK_M), computes outᵀ = W · quant(A)ᵀ (weights on the MMA's wide M side, tokens on its
narrow N side: decode has few tokens per expert), and applies scale_w · scale_a per 128-deep step
in fp32. With SWIGLU it also reads the matching up-projection slab (rows N..2N of W) and writes
silu(min(g, L)) · clamp(u, −L, L) · route_w in bf16; otherwise it writes the product in bf16.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.reference import GROUP

BLOCK_K = GROUP  # one weight scale and one activation scale per K step


@triton.jit
def _pow2_ceil(value):
    """Smallest power of two ≥ value (positive normal fp32), exactly, from the bits."""
    bits = value.to(tl.int32, bitcast=True)
    exponent = (bits >> 23) & 255
    has_mantissa = ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return ((exponent + has_mantissa) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _round_to_e4m3_grid(v):
    """Round fp32 |v| ≤ 448 to the nearest e4m3 value, ties to even, staying in fp32.

    The cast to e4m3 that follows is then exact on every backend (Triton's interpreter rounds
    fp32 → fp8 half-up without carrying into the exponent, so it must never have to round).
    """
    bits = v.to(tl.int32, bitcast=True)
    # Normal range (|v| ≥ 2^-6): keep 3 mantissa bits, ties to even, carries into the exponent.
    normal = ((bits + (0x7FFFF + ((bits >> 20) & 1))) & -0x100000).to(tl.float32, bitcast=True)
    # Subnormal range: multiples of 2^-9; adding 1.5·2^14 leaves exactly that grid (ties to even).
    sub = (v + 24576.0) - 24576.0
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def _quantize_rows(a):
    """fp32 [M, 128] → (e4m3 [M, 128], fp32 power-of-two scale [M]); |a / scale| ≤ 448 by construction."""
    amax = tl.max(tl.abs(a), axis=1)
    scale = _pow2_ceil(tl.maximum(amax * (1.0 / 448.0), 1.1754943508222875e-38))
    # 1/scale is exact: negate the exponent (scale = 2^(b-127) with b in [1, 254]).
    inv_bits = (254 - ((scale.to(tl.int32, bitcast=True) >> 23) & 255)) << 23
    inv_scale = inv_bits.to(tl.float32, bitcast=True)
    return _round_to_e4m3_grid(a * inv_scale[:, None]).to(tl.float8e4nv), scale


@triton.jit
def _moe_gemm_kernel(
    a_ptr, row_ids_ptr, route_w_ptr, counts_ptr, active_ptr, num_active_ptr,
    w_ptr, w_scale_ptr, out_ptr,
    capacity, a_row_stride, swiglu_limit,
    N_OUT: tl.constexpr, K: tl.constexpr,
    GATHER: tl.constexpr, SWIGLU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    NUM_N_TILES: tl.constexpr = N_OUT // BLOCK_N
    N_W: tl.constexpr = 2 * N_OUT if SWIGLU else N_OUT
    K_BLOCKS: tl.constexpr = K // BLOCK_K
    SCALE_ROWS: tl.constexpr = N_W // BLOCK_K  # scale-block rows per expert
    UP_SCALE_OFFSET: tl.constexpr = (N_OUT // BLOCK_K) * K_BLOCKS
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    num_work = tl.load(num_active_ptr) * NUM_N_TILES
    # while loops over device-read bounds (the interpreter's range() wants host ints).
    work = tl.program_id(0)
    while work < num_work:
        expert = tl.load(active_ptr + work // NUM_N_TILES).to(tl.int64)
        n0 = (work % NUM_N_TILES) * BLOCK_N
        count = tl.load(counts_ptr + expert)
        w_ptrs = w_ptr + (expert * N_W + n0 + offs_n)[:, None] * K + offs_k[None, :]
        scale_ptr = w_scale_ptr + (expert * SCALE_ROWS + n0 // BLOCK_K) * K_BLOCKS
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
            for kb in range(K_BLOCKS):
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
            out_ptrs = out_ptr + slots[None, :] * N_OUT + (n0 + offs_n)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
            m0 += BLOCK_M
        work += tl.num_programs(0)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # the interpreter: a few programs still exercise the persistent loop


def _num_programs(device: torch.device, num_work_max: int, programs_per_sm: int) -> int:
    return max(1, min(num_work_max, _num_sms(device) * programs_per_sm))


def default_block_m(expected_m: float) -> int:
    """Tokens per MMA tile: covers ~1.5× the mean tokens per expert (one weight pass for most)."""
    return max(16, min(64, triton.next_power_of_2(int(1.5 * expected_m + 0.999))))


def moe_grouped_gemm(
    a: torch.Tensor,
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
    num_stages: int = 3,
    programs_per_sm: int = 2,
) -> torch.Tensor:
    """Launch the masked grouped GEMM; returns ``out_dtype`` (bf16 or fp32) [E, cap, N_out].

    Slots ≥ counts[e] are not written.

    a: [T, K] rows picked through ``meta["row_ids"]`` when ``gather``, else [E, cap, K]; w e4m3
    [E, N_w, K]; w_scale fp32 [E, N_w/128, K/128]; meta from ``reference.route_metadata``.
    With ``swiglu_limit`` the gate/up rows are fused (N_out = N_w/2) and ``meta["route_w"]`` applied.
    Matches ``reference.moe_grouped_gemm`` on the written slots.
    """
    num_experts, n_w, k = w.shape
    capacity = meta["row_ids"].shape[1]
    n_out = n_w // 2 if swiglu_limit is not None else n_w
    if w.dtype != torch.float8_e4m3fn or w_scale.dtype != torch.float32:
        raise TypeError(f"expected e4m3 weights and fp32 scales, got {w.dtype}, {w_scale.dtype}")
    if k % BLOCK_K or n_out % GROUP or GROUP % block_n:
        raise ValueError(f"K={k} and N={n_out} must be multiples of {GROUP}; block_n must divide {GROUP}")
    if w_scale.shape != (num_experts, n_w // GROUP, k // GROUP):
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} != {(num_experts, n_w // GROUP, k // GROUP)}")
    if gather:
        if a.ndim != 2 or a.shape[1] != k:
            raise ValueError(f"gathered activations must be [T, {k}], got {tuple(a.shape)}")
    elif a.shape != (num_experts, capacity, k):
        raise ValueError(f"masked activations must be {(num_experts, capacity, k)}, got {tuple(a.shape)}")
    if not (a.stride(-1) == 1 if gather else a.is_contiguous()):
        a = a.contiguous()  # gathered rows need unit channel stride; masked slots a dense grid
    out = torch.empty(num_experts, capacity, n_out, dtype=out_dtype, device=a.device)
    if block_m is None:
        block_m = default_block_m(meta["slot_of"].numel() / num_experts)
    if num_warps is None:  # at most 64 fp32 accumulators per thread (BLOCK_M 64 with SwiGLU spilled at 4 warps)
        num_accumulators = 2 if swiglu_limit is not None else 1
        num_warps = min(8, max(4, block_n * block_m * num_accumulators // (32 * 64)))
    num_work_max = num_experts * (n_out // block_n)
    grid = (_num_programs(a.device, num_work_max, programs_per_sm),)
    _moe_gemm_kernel[grid](
        a, meta["row_ids"], meta["route_w"], meta["counts"], meta["active"], meta["num_active"],
        w, w_scale, out,
        capacity, a.stride(-2), float(swiglu_limit or 0.0),
        N_OUT=n_out, K=k, GATHER=gather, SWIGLU=swiglu_limit is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=num_warps, num_stages=num_stages,
    )
    return out


def moe_experts(
    x: torch.Tensor,
    meta: dict[str, torch.Tensor],
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: float,
) -> torch.Tensor:
    """Routed experts of one layer: x [T, D] → fp32 [T, D]; gate/up+SwiGLU, down, then the combine.

    The combine (a gather-sum over each token's k slots) is plain torch for now.
    """
    h = moe_grouped_gemm(x, w13, w13_scale, meta, gather=True, swiglu_limit=swiglu_limit)
    y = moe_grouped_gemm(h, w2, w2_scale, meta, gather=False)
    slot_of = meta["slot_of"]
    return y.view(-1, y.shape[-1])[slot_of.reshape(-1)].view(*slot_of.shape, -1).float().sum(1)
