"""MXFP4 grouped GEMM for the routed experts, masked layout, graph-safe; gate/up fused with the clamped SwiGLU.

The routed experts stay as released (model/deepseek_v41/quant.py): e2m1 codes packed two per byte (column
2j in the low nibble of byte j, 2j+1 in the high one) with one e8m0 scale per row and 32 columns. A stack is
``w`` uint8 [E, N_w, K/2] and ``w_scale`` uint8 [E, N_w, K/32] (the scales' raw bytes, biased exponents).

Each K step (``BLOCK_K``) loads a [BLOCK_N, BLOCK_K/2] slab of bytes and its [BLOCK_N, BLOCK_K/32] scales
and dequantises them in registers to bf16, exactly: an e2m1 code's bits placed in an fp32 word (sign at bit
31, its two exponent bits and one mantissa bit at bits 22-24) are the value times 2^-126, code 1 (0.5) a
subnormal; one fp32 multiply by 2^(scale byte − 1) makes the value times its scale, exactly, and bf16 holds
every such product (one mantissa bit, and an exponent inside bf16's range); the factor is a normal fp32 for
scale bytes 0 … 128 (scales up to 2^1), which ``check_scales`` enforces at load. The activations are rounded
to bf16 (nearest even); the MMA is bf16 × bf16 with an fp32 accumulator, so each product is exact and only
the activation's rounding and the sum's order differ from the fp32 model. Even and odd K columns are the
low and high nibbles: the activation tile is split into its even and odd columns (``tl.split``) and each
half meets its nibbles in one dot.

Why bf16 rather than FP8 (W4A8): e2m1 × a per-32 scale fits e4m3 only where a tile's scales span few
binades, and the activations' per-128 e4m3 rounding is coarser than bf16's; decode reads the weights
once per step at any width, so the MMA's rate does not bound it.

Masked layout and work items as ``kernels/moe_grouped_gemm.py``: expert e owns slots [e, 0:counts[e]) of a
fixed [E, capacity] grid; a persistent grid of programs takes (active expert, N tile) items, the counts
and the active list read on the device, so a step can be captured in a CUDA graph. The SwiGLU epilogue
writes silu(min(g, L)) · clamp(u, −L, L) · route_w in bf16; the down GEMM reads it ungathered.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import invariance
from kernels.device import num_sms

BLOCK_K = 64
"""K columns per step: 32 bytes of codes and 2 scales per weight row. 128 held twice the dequantised fp32 values
in registers: ptxas for sm_90a (scripts/dev/compile_sm90.py, v41-s1's gate/up with SwiGLU) spilled at BLOCK_M 64 ×
BLOCK_N 128 even at 8 warps, and used 230 registers at decode's 16 × 64; at 64 the same tiles took 230 (8 warps, no
spill) and 150 (4 warps)."""
SCALE_GROUP = 32  # columns per e8m0 scale (the checkpoint's)
MIN_SCALE_BYTE, MAX_SCALE_BYTE = 0, 128
"""The e8m0 bytes the in-register dequantisation takes (scales 2^-127 … 2^1): the factor 2^(byte − 1) is built
as a normal fp32 (biased exponent byte + 126 ≤ 254), and every product is then a bf16 value."""


@triton.jit
def _dequant(packed, scale_bytes, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """uint8 [BLOCK_N, BLOCK_K/2] codes and uint8 [BLOCK_N, BLOCK_K/32] scales → fp32 (low, high) nibbles'
    values [BLOCK_N, BLOCK_K/2] (columns 2j and 2j+1), exact (see the module docstring)."""
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    p = packed.to(tl.int32)
    lo = ((p & 8) << 28) | ((p & 7) << 22)
    hi = ((p & 128) << 24) | ((p & 112) << 18)
    s = ((scale_bytes.to(tl.int32) + 126) << 23).to(tl.float32, bitcast=True)  # 2^(byte − 1) = scale · 2^126
    s = tl.broadcast_to(s[:, :, None], (BLOCK_N, GROUPS, 16)).reshape(BLOCK_N, HALF)
    return lo.to(tl.float32, bitcast=True) * s, hi.to(tl.float32, bitcast=True) * s


@triton.jit(do_not_specialize=("capacity", "out_stride_e"))
def _moe_fp4_kernel(
    a_ptr,
    row_ids_ptr,
    route_w_ptr,
    counts_ptr,
    active_ptr,
    num_active_ptr,
    w_ptr,
    w_scale_ptr,
    out_ptr,
    capacity,
    a_row_stride,
    swiglu_limit,
    out_stride_e,
    out_stride_m,
    N_OUT: tl.constexpr,
    K: tl.constexpr,
    GATHER: tl.constexpr,
    SWIGLU: tl.constexpr,
    DOT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    NUM_N_TILES: tl.constexpr = N_OUT // BLOCK_N
    N_W: tl.constexpr = 2 * N_OUT if SWIGLU else N_OUT
    K_BLOCKS: tl.constexpr = K // BLOCK_K
    HALF: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 32
    offs_j = tl.arange(0, HALF)
    offs_g = tl.arange(0, GROUPS)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = tl.arange(0, BLOCK_N)
    num_work = tl.load(num_active_ptr) * NUM_N_TILES
    work = tl.program_id(0)
    while work < num_work:  # while loops over device-read bounds (the interpreter's range() wants host ints)
        expert = tl.load(active_ptr + work // NUM_N_TILES).to(tl.int64)
        n0 = (work % NUM_N_TILES) * BLOCK_N
        count = tl.load(counts_ptr + expert)
        w_rows = expert * N_W + n0 + offs_n  # int64 [BLOCK_N]
        w_ptrs = w_ptr + w_rows[:, None] * (K // 2) + offs_j[None, :]
        s_ptrs = w_scale_ptr + w_rows[:, None] * (K // 32) + offs_g[None, :]
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
                a = tl.load(a_ptrs + kb * BLOCK_K, mask=m_ok[:, None], other=0.0).to(tl.bfloat16)
                a_even, a_odd = tl.split(a.reshape(BLOCK_M, HALF, 2))
                if not DOT_BF16:  # the interpreter: fp32 operands holding the same bf16 values
                    a_even = a_even.to(tl.float32)
                    a_odd = a_odd.to(tl.float32)
                a_even = tl.trans(a_even)
                a_odd = tl.trans(a_odd)
                lo, hi = _dequant(tl.load(w_ptrs + kb * HALF), tl.load(s_ptrs + kb * GROUPS), BLOCK_N, BLOCK_K)
                if DOT_BF16:
                    acc = tl.dot(lo.to(tl.bfloat16), a_even, acc)
                    acc = tl.dot(hi.to(tl.bfloat16), a_odd, acc)
                else:
                    acc = tl.dot(lo, a_even, acc, input_precision="ieee")
                    acc = tl.dot(hi, a_odd, acc, input_precision="ieee")
                if SWIGLU:
                    lo, hi = _dequant(
                        tl.load(w_ptrs + N_OUT * (K // 2) + kb * HALF),
                        tl.load(s_ptrs + N_OUT * (K // 32) + kb * GROUPS),
                        BLOCK_N,
                        BLOCK_K,
                    )
                    if DOT_BF16:
                        acc_up = tl.dot(lo.to(tl.bfloat16), a_even, acc_up)
                        acc_up = tl.dot(hi.to(tl.bfloat16), a_odd, acc_up)
                    else:
                        acc_up = tl.dot(lo, a_even, acc_up, input_precision="ieee")
                        acc_up = tl.dot(hi, a_odd, acc_up, input_precision="ieee")
            if SWIGLU:
                gate = tl.minimum(acc, swiglu_limit)
                up = tl.minimum(tl.maximum(acc_up, -swiglu_limit), swiglu_limit)
                route_w = tl.load(route_w_ptr + slots, mask=m_ok, other=0.0)
                acc = gate / (1.0 + tl.exp(-gate)) * up * route_w[None, :]
            out_rows = expert * out_stride_e + offs_m.to(tl.int64) * out_stride_m
            out_ptrs = out_ptr + out_rows[None, :] + (n0 + offs_n)[:, None]
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_ok[None, :])
            m0 += BLOCK_M
        work += tl.num_programs(0)


@functools.cache
def _num_programs(device: torch.device, num_work_max: int, programs_per_sm: int) -> int:
    return max(1, min(num_work_max, num_sms(device, off_gpu=4) * programs_per_sm))


def default_num_warps(block_m: int, block_n: int, swiglu: bool) -> int:
    """8 warps from 8K accumulators a tile (gate and up counted), else 4: ptxas (sm_90a) spilled 24 bytes at
    64 × 64 with SwiGLU on 4 warps, none on 8; 16 × 64 and 16 × 128 took 150 and 168 registers on 4."""
    return 8 if block_m * block_n * (2 if swiglu else 1) >= 8192 else 4


def programs_per_sm(num_warps: int) -> int:
    """Persistent programs per SM that fit its 64K registers at the registers ptxas gave (≤ 168 a thread at 4
    warps on decode's tiles: 3 of 128 threads; ≤ 255 at 8 warps: 1 of 256)."""
    return 3 if num_warps == 4 else 1


def default_block_m(expected_m: float) -> int:
    """Tokens per MMA tile: ~1.5× the mean tokens per expert, 16 … 64 (``moe_grouped_gemm``'s rule)."""
    return max(16, min(64, triton.next_power_of_2(int(1.5 * expected_m + 0.999))))


def default_block_n(num_slabs_128: int, device: torch.device) -> int:
    """128 weight rows per item where the 128-row slabs fill the programs, else 64: batch 1's 6 active experts
    have 6 · 18 gate/up slabs at v41-s1, fewer than 3 per SM of an H100."""
    return 128 if num_slabs_128 >= programs_per_sm(4) * num_sms(device, off_gpu=4) else 64


def check_scales(w_scale: torch.Tensor) -> None:
    """Raise ValueError unless every e8m0 byte is one the kernel dequantises exactly (``MIN_SCALE_BYTE`` …
    ``MAX_SCALE_BYTE``)."""
    raw = w_scale.view(torch.uint8)
    low, high = int(raw.min()), int(raw.max())
    if low < MIN_SCALE_BYTE or high > MAX_SCALE_BYTE:
        raise ValueError(
            f"MXFP4 scale bytes {low} … {high} outside {MIN_SCALE_BYTE} … {MAX_SCALE_BYTE} (2^-127 … 2^1): "
            "these experts need --expert-format fp8"
        )


def moe_grouped_gemm_fp4(
    a: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    meta: dict[str, torch.Tensor],
    *,
    gather: bool,
    swiglu_limit: float | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int | None = None,
    block_n: int | None = None,
    dot_fp32: bool = False,
    num_warps: int | None = None,
    num_stages: int = 3,
) -> torch.Tensor:
    """The masked grouped GEMM on MXFP4 weights: [E, cap, N_out] in ``out_dtype`` (bf16, or fp32 for tests; slots
    ≥ counts[e] unwritten).

    a: [T, K] rows picked through ``meta["row_ids"]`` when ``gather``, else [E, cap, K] (bf16 or fp32, rounded
    to bf16); w uint8 [E, N_w, K/2] and w_scale uint8 [E, N_w, K/32] (module docstring); ``swiglu_limit``
    fuses gate rows [0, N_w/2) and up rows [N_w/2, N_w) with ``meta["route_w"]``. ``out``: a view of
    that shape and dtype whose channels are dense (a slice of a bigger stack). ``dot_fp32``: fp32 operands (the CPU
    interpreter has no bf16 dot), the same values."""
    num_experts, n_w, k_half = w.shape
    k = 2 * k_half
    capacity = meta["row_ids"].shape[1]
    n_out = n_w // 2 if swiglu_limit is not None else n_w
    if w.dtype != torch.uint8 or w_scale.dtype != torch.uint8:
        raise TypeError(f"expected uint8 codes and uint8 scale bytes, got {w.dtype}, {w_scale.dtype}")
    if k % BLOCK_K or n_out % 128:
        raise ValueError(f"K={k} and N={n_out} must be multiples of {BLOCK_K} and 128")
    if k % SCALE_GROUP:
        raise ValueError(f"K={k} must be a multiple of {SCALE_GROUP}")
    if w_scale.shape != (num_experts, n_w, k // SCALE_GROUP):
        raise ValueError(f"w_scale shape {tuple(w_scale.shape)} != {(num_experts, n_w, k // SCALE_GROUP)}")
    rows_shape = (a.shape[0], k) if gather else (num_experts, capacity, k)
    if a.shape != rows_shape or (gather and a.ndim != 2):
        raise ValueError(f"activations must be {rows_shape}, got {tuple(a.shape)}")
    a = a.contiguous()
    w, w_scale = w.contiguous(), w_scale.contiguous()
    if out is None:
        out = torch.empty(num_experts, capacity, n_out, dtype=out_dtype, device=a.device)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype must be bf16 or fp32, got {out_dtype}")
    if out.shape != (num_experts, capacity, n_out) or out.dtype != out_dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {out_dtype} [{num_experts}, {capacity}, {n_out}] with dense channels")
    if block_m is None:
        block_m = invariance.BLOCK_M if invariance.active() else default_block_m(meta["slot_of"].numel() / num_experts)
    if block_n is None:
        block_n = default_block_n(meta["slot_of"].shape[1] * n_out // 128, a.device)
    if num_warps is None:
        num_warps = default_num_warps(block_m, block_n, swiglu_limit is not None)
    num_work_max = num_experts * (n_out // block_n)
    grid = (_num_programs(a.device, num_work_max, programs_per_sm(num_warps)),)
    _moe_fp4_kernel[grid](
        a,
        meta["row_ids"],
        meta["route_w"],
        meta["counts"],
        meta["active"],
        meta["num_active"],
        w,
        w_scale,
        out,
        capacity,
        k,
        float(swiglu_limit or 0.0),
        out.stride(0),
        out.stride(1),
        N_OUT=n_out,
        K=k,
        GATHER=gather,
        SWIGLU=swiglu_limit is not None,
        DOT_BF16=not dot_fp32,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
