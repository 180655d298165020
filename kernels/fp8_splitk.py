"""Split-K FP8 linear for decode's few rows: y = x · Wᵀ with the one-expert GEMM's formats (e4m3 weights
with 128×128 block scales, e4m3 activations with one scale per 128 channels, ``quant_fp8.quantize_act``).

At T ≤ 16 a projection with few 128-wide N tiles gives the grouped GEMM few programs: v41's wq_a has
10 and wkv 4 on 132 SMs, each streaming all of K, far below HBM bandwidth (docs/performance.md, "Kernels").
Here program (n tile, split) streams K blocks [split·KB, (split+1)·KB) and writes an fp32
partial product. The last of an N tile's programs to finish adds the tile's partials in split order
and casts (``one_launch``; else a second launch does, in the same order, with the same bits). The split
count depends on N and K only (never on T), so a row's result does not depend on the rest of the
batch; the order of the sum differs from the grouped GEMM's one pass (fp32 rounding apart, the same
products).

Which program is last is decided by a per-N-tile ticket counter (an integer atomic, acquire-release at
GPU scope): only *who* sums depends on timing, never the order of the sum, so the result is the same
bits on every run. The last program puts the counter back to 0, so counters are 0 between launches
(and graph replays); they are per device and size, and the launches on a device are assumed to run
one at a time (one compute stream), as the worker's do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import num_sms
from kernels.quant_fp8 import _quantize_rows

BLOCK_N = 128
BLOCK_K = 128
MAX_TOKENS = 16
"""Rows per launch: the tokens are the MMA's narrow side, one 16-wide tile."""
# ptxas sm_90a, 4 warps, v41 wq_a: 2 K blocks per split (an unrolled loop) spill 136 bytes; 1 uses
# 70 registers and 4, 5, 8, 10 use 130, without spills.


@triton.jit(do_not_specialize=("num_tokens",))
def _splitk_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    part_ptr,
    out_ptr,
    ticket_ptr,
    num_tokens,
    a_row_stride,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCKS_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    SUM: tl.constexpr,
    A_FP8: tl.constexpr,
):
    """A_FP8: a is e4m3 with fp32 scales [T, K/128]; else a is bf16/fp32, each 128-channel block quantised
    here by ``quant_fp8._quantize_rows`` (``quantize_act``'s rounding: the same e4m3 values and scales).
    part [SPLIT, T, N] fp32: split s's product over its BLOCKS_PER_SPLIT K blocks (which divide
    K/128: no split is short, so no K mask), in K order. SUM: the N tile's last program also writes
    out [T, N] = Σ_s part[s] in split order (``_sum_splits_kernel``'s sum), ticket [N/BLOCK_N] int32."""
    K_BLOCKS: tl.constexpr = K // BLOCK_K
    n0 = tl.program_id(0) * BLOCK_N
    split = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < num_tokens
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for i in range(BLOCKS_PER_SPLIT):
        kb = split * BLOCKS_PER_SPLIT + i
        a_ptrs = a_ptr + offs_m[:, None] * a_row_stride + kb * BLOCK_K + offs_k[None, :]
        if A_FP8:
            a_q = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
            a_scale = tl.load(a_scale_ptr + offs_m * K_BLOCKS + kb, mask=m_ok, other=0.0)
        else:  # rows past T read 0: code 0 (their scale is never stored)
            a_q, a_scale = _quantize_rows(tl.load(a_ptrs, mask=m_ok[:, None], other=0.0).to(tl.float32))
        w = tl.load(w_ptr + (n0 + offs_n)[:, None] * K + kb * BLOCK_K + offs_k[None, :])
        w_scale = tl.load(w_scale_ptr + (n0 // BLOCK_K) * K_BLOCKS + kb)
        acc += tl.dot(w, tl.trans(a_q)) * (w_scale * a_scale)[None, :]
    rows = (split * num_tokens + offs_m).to(tl.int64)
    tl.store(part_ptr + rows[None, :] * N + (n0 + offs_n)[:, None], acc, mask=m_ok[None, :])
    if SUM:
        # Every thread's partial is stored before the ticket is taken (the barrier), and released with it;
        # the last program's acquire makes all SPLIT partials visible to it (read from L2: ".cg").
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
        if ticket == SPLIT - 1:
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                at = (s * num_tokens + offs_m).to(tl.int64)[None, :] * N + (n0 + offs_n)[:, None]
                total += tl.load(part_ptr + at, mask=m_ok[None, :], other=0.0, cache_modifier=".cg")
            tl.store(
                out_ptr + offs_m.to(tl.int64)[None, :] * N + (n0 + offs_n)[:, None],
                total.to(out_ptr.dtype.element_ty),
                mask=m_ok[None, :],
            )
            tl.store(ticket_ptr + tl.program_id(0), 0)  # 0 again for the next launch or graph replay


@triton.jit(do_not_specialize=("size",))
def _sum_splits_kernel(part_ptr, out_ptr, size, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """out [T·N] = Σ_s part[s] in split order, cast to out's dtype."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < size
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        total += tl.load(part_ptr + s * size + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}
"""Per (device, N tiles): the ticket counters, zero between launches. Never freed: a captured graph
reads them by address."""


def _tickets(device: torch.device, n_tiles: int) -> torch.Tensor:
    key = (torch.device(device), n_tiles)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(n_tiles, dtype=torch.int32, device=device)
    return _TICKETS[key]


def num_splits(n: int, k: int, device: torch.device) -> tuple[int, int]:
    """(splits, K blocks per split): the fewest blocks per split that divides K/128 and gives at most
    four programs per SM, never 2 or 3 blocks (those loops unroll and spill). A function of N and K."""
    n_tiles, k_blocks = n // BLOCK_N, k // BLOCK_K
    most = max(1, triton.cdiv(4 * num_sms(device, off_gpu=132), n_tiles))
    per = next(p for p in range(1, k_blocks + 1) if k_blocks % p == 0 and p not in (2, 3) and k_blocks // p <= most)
    return k_blocks // per, per


def worth_splitting(n: int, device: torch.device) -> bool:
    """Fewer N tiles than SMs: the one-pass grid leaves SMs idle."""
    return n // BLOCK_N < num_sms(device, off_gpu=132)


def fp8_linear_splitk(
    a: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
    *,
    one_launch: bool = True,
) -> torch.Tensor:
    """a = (e4m3 [T, K], fp32 scales [T, K/128]), or bf16/fp32 [T, K] quantised inside the kernel as
    ``quant_fp8.quantize_act`` would (the same bits, without its launch), with T ≤ MAX_TOKENS; w e4m3 [N, K]
    (or [1, N, K]), w_scale fp32 [N/128, K/128] (or [1, …]) → [T, N] in ``out_dtype``. K and N multiples of
    128. ``one_launch`` False: the partials summed by a second launch (the same bits; kept to test and time
    against)."""
    a_fp8 = isinstance(a, tuple)
    a_q, a_scale = a if a_fp8 else (a, None)
    w, w_scale = w.reshape(w.shape[-2], w.shape[-1]), w_scale.reshape(w_scale.shape[-2], w_scale.shape[-1])
    num_tokens, k = a_q.shape
    n = w.shape[0]
    if num_tokens > MAX_TOKENS:
        raise ValueError(f"{num_tokens} rows: the split-K linear takes at most {MAX_TOKENS}")
    if w.shape[1] != k or k % BLOCK_K or n % BLOCK_N or w_scale.shape != (n // BLOCK_N, k // BLOCK_K):
        raise ValueError(
            f"weights {tuple(w.shape)} / scales {tuple(w_scale.shape)} do not fit activations "
            f"{tuple(a_q.shape)} (multiples of 128)"
        )
    if a_fp8 and (a_q.dtype != torch.float8_e4m3fn or a_scale.shape != (num_tokens, k // BLOCK_K)):
        raise ValueError(
            f"pre-quantised activations need e4m3 values and scales [{num_tokens}, {k // BLOCK_K}], "
            f"got {a_q.dtype}, {tuple(a_scale.shape)}"
        )
    if not a_fp8 and a_q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"activations must be bf16/fp32 or an (e4m3, scales) pair, got {a_q.dtype}")
    out = torch.empty(num_tokens, n, dtype=out_dtype, device=a_q.device)
    if num_tokens == 0:
        return out
    splits, per = num_splits(n, k, a_q.device)
    part = torch.empty(splits, num_tokens, n, dtype=torch.float32, device=a_q.device)
    a_q = a_q.contiguous()
    a_scale = a_q if a_scale is None else a_scale.contiguous()  # unread without A_FP8
    _splitk_kernel[(n // BLOCK_N, splits)](
        a_q,
        a_scale,
        w,
        w_scale,
        part,
        out,
        _tickets(a_q.device, n // BLOCK_N),
        num_tokens,
        a_q.stride(0),
        N=n,
        K=k,
        BLOCKS_PER_SPLIT=per,
        BLOCK_M=16,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        SPLIT=splits,
        SUM=one_launch,
        A_FP8=a_fp8,
        num_warps=4,
        num_stages=3,
    )
    if not one_launch:
        size = num_tokens * n
        _sum_splits_kernel[(triton.cdiv(size, 1024),)](part, out, size, SPLIT=splits, BLOCK=1024, num_warps=4)
    return out
