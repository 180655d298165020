"""Window-K write: FP8 e4m3 quantisation of each row's K and its scatter into the state slots' rings.

One launch does what ``CacheEngine.write_window``'s torch form does in about 14 (pad, abs, amax,
clamp, scale arithmetic, divide, clamp, cast, two byte views, cat, index_put). Per row n, channel
block b of 32 (spec §3.5, ``model.deepseek_v41.quant.quantize_fp8_cache``):

    scale_b = pow2_ceil(max(amax_b, 1e-4) · (1/448))      byte = its biased exponent (e8m0)
    q       = e4m3_rne(k / scale_b)                         |k / scale_b| ≤ 448 (see ``_write_window_kernel``)

and the ring entry ``ring[slots[n], ring_slots[n]]`` gets ``head_dim`` e4m3 bytes then
``head_dim / 32`` e8m0 bytes, the layout ``CacheEngine.read_window`` decodes. Every step is exact
(a max, power-of-two scales, one rounding), so the bytes equal the torch form's ``==``
(tests/kernels/test_window_write.py). Rows must address distinct ring entries (a decode step's do).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_fp8 import _pow2_ceil, _round_to_e4m3_grid

BLOCK = 32  # channels per scale (model.deepseek_v41.quant.FP8_CACHE_BLOCK)


@triton.jit
def _write_window_kernel(
    k_ptr,
    ring_ptr,
    slots_ptr,
    ring_slots_ptr,
    k_row_stride,
    slot_stride,
    entry_stride,
    HEAD_DIM: tl.constexpr,
    GROUPS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    groups = tl.arange(0, GROUPS)
    cols = groups[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [GROUPS, BLOCK]; GROUPS a power of two
    ok = cols < HEAD_DIM
    k = tl.load(k_ptr + row.to(tl.int64) * k_row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(k), axis=1)  # [GROUPS]; exact, so any reduction order gives the torch bits
    # fp32 like torch's clamp_min(1e-4) · (1/448): both constants round to the same fp32 values.
    scale = _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
    biased = (scale.to(tl.int32, bitcast=True) >> 23) & 255  # scale ≥ 2^-22 and ≤ 2^120: a normal exponent
    # k · 2^-e equals torch's k / 2^e (the same real value, rounded once). fl(amax · fl(1/448)) is at least
    # amax/448 · (1 − 2^-24)², so |k / scale| < 448.0001, which e4m3 rounds to 448: the torch form's
    # clamp to ±448 never changes a value; it is kept as a guard that costs no launch.
    inv_scale = ((254 - biased) << 23).to(tl.float32, bitcast=True)
    v = tl.minimum(tl.maximum(k * inv_scale[:, None], -448.0), 448.0)
    q = _round_to_e4m3_grid(v).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    entry = (
        ring_ptr
        + tl.load(slots_ptr + row).to(tl.int64) * slot_stride
        + tl.load(ring_slots_ptr + row).to(tl.int64) * entry_stride
    )
    tl.store(entry + cols, q, mask=ok)
    tl.store(entry + HEAD_DIM + groups, biased.to(tl.uint8), mask=groups * BLOCK < HEAD_DIM)


def write_window(ring: torch.Tensor, slots: torch.Tensor, ring_slots: torch.Tensor, k: torch.Tensor) -> None:
    """ring uint8 [num_state_slots, ring_size, head_dim + head_dim/32] (``CacheEngine.ring``, bytes
    contiguous), slots / ring_slots int [N], k [N, head_dim] (fp32/bf16, head_dim % 32 == 0) → written."""
    num_rows, head_dim = k.shape
    if head_dim % BLOCK:
        raise ValueError(f"write_window needs head_dim a multiple of {BLOCK}, got {head_dim}")
    if ring.dtype != torch.uint8 or ring.ndim != 3 or ring.shape[2] != head_dim + head_dim // BLOCK:
        raise ValueError(
            f"ring must be uint8 [slots, ring, {head_dim + head_dim // BLOCK}], got {ring.dtype} {tuple(ring.shape)}"
        )
    if ring.stride(2) != 1:
        raise ValueError("ring entries must be contiguous bytes")
    if slots.shape != (num_rows,) or ring_slots.shape != (num_rows,):
        raise ValueError(f"slots {tuple(slots.shape)} and ring_slots {tuple(ring_slots.shape)} must be [{num_rows}]")
    if num_rows == 0:
        return
    if k.stride(1) != 1:
        k = k.contiguous()
    groups = head_dim // BLOCK
    _write_window_kernel[(num_rows,)](
        k,
        ring,
        slots,
        ring_slots,
        k.stride(0),
        ring.stride(0),
        ring.stride(1),
        HEAD_DIM=head_dim,
        GROUPS=triton.next_power_of_2(groups),
        BLOCK=BLOCK,
    )
