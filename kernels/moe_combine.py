"""The MoE combine: each token's expert outputs summed in fp32, in one fixed order, in one launch.

y [E, cap, D] holds the down projections of every (expert, slot) (route weights already applied);
``slot_of`` [T, k] gives token t's k flat slots (e · cap + slot). The sum runs over the columns in
order, or, with ``shared_last`` (``KernelMoE``'s layout, the shared expert stacked as column k − 1),
the shared expert's column first and then the routed picks in top-k order: the order the model's MoE
adds them (model/deepseek_v41/moe.py), so a token's sum never depends on the batch or the routing of
other tokens. Replaces a gather of [T, k, D] and a torch ``sum(1)`` (whose reduction order is ATen's
choice). Reference: ``kernels.reference.moe_combine``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 512


@triton.jit
def _combine_kernel(
    y_ptr,
    slot_ptr,
    live_ptr,
    out_ptr,
    D,
    W,
    K: tl.constexpr,
    SHARED_LAST: tl.constexpr,
    USE_LIVE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < W  # the W ≤ D leading columns
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    if SHARED_LAST:
        slot = tl.load(slot_ptr + token * K + K - 1)
        acc += tl.load(y_ptr + slot * D + cols, mask=ok, other=0.0).to(tl.float32)
    for j in tl.static_range(K - 1 if SHARED_LAST else K):
        slot = tl.load(slot_ptr + token * K + j)
        acc += tl.load(y_ptr + slot * D + cols, mask=ok, other=0.0).to(tl.float32)
    if USE_LIVE:  # torch.where(live, acc, 0.0): a dead row's slots hold any bytes (NaN too); it gets +0.0
        acc = tl.where(tl.load(live_ptr + token) != 0, acc, 0.0)
    tl.store(out_ptr + token * W + cols, acc, mask=ok)


def moe_combine(
    y: torch.Tensor,
    slot_of: torch.Tensor,
    shared_last: bool = False,
    *,
    live: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """y [E, cap, D] (bf16/fp32), slot_of int [T, k] flat slots → fp32 [T, width] (see the module docstring).

    ``live`` bool [T] (None: every row): rows outside it come out +0.0, as ``torch.where(live, out, 0.0)``
    makes them (their slots are not meaningful). ``width`` (None: D): only the leading columns, as
    ``out[:, :width]`` (the sums of a column do not depend on the others)."""
    dim = y.shape[-1]
    num_tokens, k = slot_of.shape
    width = dim if width is None else width
    if not 0 <= width <= dim:
        raise ValueError(f"width {width} must be within y's {dim} columns")
    if live is not None and live.shape != (num_tokens,):
        raise ValueError(f"live must be [{num_tokens}], got {tuple(live.shape)}")
    out = torch.empty(num_tokens, width, dtype=torch.float32, device=y.device)
    if num_tokens == 0:
        return out
    y = y.reshape(-1, dim)
    if y.stride(-1) != 1 or y.stride(0) != dim:
        y = y.contiguous()
    slots = slot_of.to(torch.int64).contiguous()
    live = None if live is None else (live.view(torch.uint8) if live.dtype == torch.bool else live).contiguous()
    _combine_kernel[(num_tokens, triton.cdiv(width, BLOCK_D))](
        y,
        slots,
        slots if live is None else live,
        out,
        dim,
        width,
        K=k,
        SHARED_LAST=shared_last,
        USE_LIVE=live is not None,
        BLOCK_D=BLOCK_D,
        num_warps=4,
    )
    return out
