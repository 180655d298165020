"""Plain-PyTorch reference of every kernel in this package: the test oracle and the CPU path.

Each function here computes exactly what its Triton kernel computes, in the same number formats
(fp32 accumulation, the same quantisation rules), so a kernel and its reference differ only by
fp32 summation order and the final rounding of the output.

Formats used by the MoE kernels (see ``kernels/fp8_weights.py`` for the load-time conversion):

- expert weights: float8_e4m3fn [E, N, K] with one fp32 power-of-two scale per 128×128 block,
  ``scale`` [E, N/128, K/128];
- activations: quantised in the kernel per token and per 128 channels to e4m3 with a power-of-two
  scale ``pow2_ceil(max(amax · (1/448), 2^-126))`` (never clips: amax / scale ≤ 448); ``pow2_ceil`` and
  the e4m3 maximum are the model's (``model/deepseek_v41/quant.py``), the one definition of the formats.

Masked ("DeepGEMM masked") layout for decode: expert e owns slots [e, 0:counts[e]] of a fixed
[E, capacity] grid; ``row_ids[e, j]`` is the token in slot j, ``route_w[e, j]`` its routing weight.
Shapes stay fixed for every batch, so the step can be captured in a CUDA graph.

The attention and indexer references live in ``kernels/reference_attention.py``, re-exported here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.deepseek_v41.quant import FP8_E4M3_MAX, pow2_ceil

GROUP = 128
"""Channels per activation scale and edge of a weight scale block."""
_INV_FP8_MAX = torch.tensor(1.0 / FP8_E4M3_MAX, dtype=torch.float32)  # fp32(1/448), as the kernels use it
_MIN_SCALE = 2.0**-126

# The attention side's references (re-exported: callers use ``reference.<name>``).
from kernels.reference_attention import (  # noqa: E402, F401
    decode_keys,
    entry_slots,
    indexer_select,
    sparse_decode_attention,
    sparse_prefill_attention,
)

# ---------------------------------------------------------------- RMSNorm


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., C] → x.dtype [..., C]: weight · x / sqrt(mean(x²) + eps), all in fp32 (spec §3.2)."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


# ---------------------------------------------------------------- FP8 activations


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., C] (C % 128 == 0) → (e4m3 [..., C], fp32 scales [..., C/128]); x ≈ q · scale."""
    if x.shape[-1] % GROUP:
        raise ValueError(f"activation channels must be a multiple of {GROUP}, got {x.shape[-1]}")
    groups = x.float().unflatten(-1, (-1, GROUP))
    amax = groups.abs().amax(-1, keepdim=True)
    scale = pow2_ceil((amax * _INV_FP8_MAX.to(x.device)).clamp_min(_MIN_SCALE))
    q = (groups * (1.0 / scale)).to(torch.float8_e4m3fn)  # |·| ≤ 448: no clipping needed
    return q.flatten(-2), scale[..., 0]


def dequantize_act(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Inverse of ``quantize_act``: fp32 [..., C]."""
    return (q.float().unflatten(-1, (-1, GROUP)) * scale.unsqueeze(-1)).flatten(-2)


def dequantize_weight_block128(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [..., N, K] with fp32 [..., N/128, K/128] block scales → fp32 [..., N, K]."""
    s = scale.repeat_interleave(GROUP, -2).repeat_interleave(GROUP, -1)
    return w.float() * s


# ---------------------------------------------------------------- MoE: routing metadata


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) · clamp(up, −L, L) in fp32 (model/deepseek_v41/moe.py)."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(min=-limit, max=limit)


def swiglu_quant(gate_up: torch.Tensor, route_w: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """gate_up [M, 2I] (gate, then up), route_w [M] → ``quantize_act``(clamped SwiGLU · route_w)
    (kernels/quant_fp8.py)."""
    inter = gate_up.shape[-1] // 2
    return quantize_act(clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], limit) * route_w.float()[:, None])


def route_metadata(
    experts: torch.Tensor, weights: torch.Tensor, num_experts: int, capacity: int | None = None
) -> dict[str, torch.Tensor]:
    """Top-k choices → the masked layout, with device ops only (no host sync: graph-safe).

    experts int [T, k] (distinct per row), weights fp32 [T, k]; ``capacity`` slots per expert
    (default T, always enough since a token picks an expert at most once). Returns int32
    ``counts`` [E], ``row_ids`` [E, cap], fp32 ``route_w`` [E, cap], int64 ``slot_of`` [T, k]
    (flat slot e·cap + j of each choice), int32 ``active`` [E] (experts with tokens first, in id
    order) and ``num_active`` [1]. Slots within an expert follow token order.
    """
    num_tokens, top_k = experts.shape
    cap = num_tokens if capacity is None else capacity
    device = experts.device
    flat = experts.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices  # choices grouped by expert, token order kept
    sorted_e = flat[order]
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    starts = torch.cumsum(counts, 0) - counts
    slot_in_expert = torch.arange(flat.numel(), device=device) - starts[sorted_e]
    flat_slot = sorted_e * cap + slot_in_expert
    row_ids = torch.zeros(num_experts * cap, dtype=torch.int32, device=device)
    row_ids[flat_slot] = (order // top_k).to(torch.int32)
    route_w = torch.zeros(num_experts * cap, dtype=torch.float32, device=device)
    route_w[flat_slot] = weights.reshape(-1).float()[order]
    slot_of = torch.empty_like(flat)
    slot_of[order] = flat_slot
    active = torch.sort((counts == 0).to(torch.int32), stable=True).indices.to(torch.int32)
    return {
        "counts": counts.to(torch.int32),
        "row_ids": row_ids.view(num_experts, cap),
        "route_w": route_w.view(num_experts, cap),
        "slot_of": slot_of.view(num_tokens, top_k),
        "active": active,
        "num_active": (counts > 0).sum().to(torch.int32).view(1),
    }


# ---------------------------------------------------------------- MoE: FP8 grouped GEMM


def moe_grouped_gemm(
    a: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    w: torch.Tensor,
    w_scale: torch.Tensor,
    counts: torch.Tensor,
    *,
    row_ids: torch.Tensor | None = None,
    route_w: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Masked FP8 grouped GEMM; returns ``out_dtype`` [E, cap, N_out], slots ≥ counts[e] left zero.

    a: bf16/fp32 activations (quantised here with ``quantize_act``) or a pre-quantised pair
    (e4m3, fp32 scales [..., K/128]); [T, K] gathered through ``row_ids`` [E, cap], or [E, cap, K]
    when ``row_ids`` is None. w: e4m3 [E, N_w, K] with fp32 block scales [E, N_w/128, K/128].
    Plain: out = quant(a) · wᵀ (N_out = N_w). With ``swiglu_limit``: rows [0, N) of w are the gate,
    [N, 2N) the up projection, and out = clamped_swiglu(gate, up) · route_w (N_out = N = N_w/2),
    as the model applies the routing weight before the down projection. ``out_dtype`` e4m3 returns
    ``quantize_act`` of that fp32 result: (e4m3 [E, cap, N_out], fp32 scales [E, cap, N_out/128]).
    """
    a_values, a_scale = a if isinstance(a, tuple) else (a, None)
    num_experts, n_w, k = w.shape
    cap = row_ids.shape[1] if row_ids is not None else a_values.shape[1]
    n_out = n_w // 2 if swiglu_limit is not None else n_w
    fp8_out = out_dtype == torch.float8_e4m3fn
    out = torch.zeros(num_experts, cap, n_out, dtype=torch.float32 if fp8_out else out_dtype, device=w.device)
    for e in range(num_experts):
        m = int(counts[e])
        if m == 0:
            continue
        rows = row_ids[e, :m].long() if row_ids is not None else None

        def pick(t: torch.Tensor, e: int = e, m: int = m, rows: torch.Tensor | None = rows) -> torch.Tensor:
            return t[rows] if rows is not None else t[e, :m]

        if a_scale is None:
            act = dequantize_act(*quantize_act(pick(a_values)))  # [m, K], exactly what the MMA sees
        else:
            act = dequantize_act(pick(a_values), pick(a_scale))
        acc = act @ dequantize_weight_block128(w[e], w_scale[e]).t()  # [m, N_w] fp32
        if swiglu_limit is not None:
            if route_w is None:
                raise ValueError("the SwiGLU epilogue applies the routing weights: pass route_w")
            h = clamped_swiglu(acc[:, :n_out], acc[:, n_out:], swiglu_limit)
            acc = h * route_w[e, :m, None]
        out[e, :m] = acc.to(out.dtype)
    if fp8_out:
        return quantize_act(out)  # empty slots: zeros → code 0
    return out


def moe_combine(
    y: torch.Tensor,
    slot_of: torch.Tensor,
    shared_last: bool = False,
    *,
    live: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """Σ over each token's k expert outputs in fp32: y [E, cap, D], slot_of [T, k] → fp32 [T, width]. The
    columns in order, or with ``shared_last`` the last one (the shared expert) first, then the others;
    +0.0 in the rows outside ``live`` bool [T] (None: every row); the first ``width`` columns (None: D)."""
    rows = y.reshape(-1, y.shape[-1])
    order = [slot_of.shape[1] - 1, *range(slot_of.shape[1] - 1)] if shared_last else range(slot_of.shape[1])
    out = torch.zeros(slot_of.shape[0], y.shape[-1], dtype=torch.float32, device=y.device)
    for j in order:
        out = out + rows[slot_of[:, j]].float()
    out = out[:, :width]
    return out if live is None else torch.where(live.unsqueeze(-1), out, 0.0)


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
    live: torch.Tensor | None = None,
    width: int | None = None,
) -> torch.Tensor:
    """The routed experts of one MoE layer: x [T, D] → fp32 [T, D] (shared expert not included); ``live`` and
    ``width`` as ``moe_combine``'s.

    ``prequantize`` (as ``kernels.moe_grouped_gemm.moe_experts``): h goes to the down projection as
    FP8 quantised from fp32; otherwise rounded to bf16 first (as the model's own MoE does), then FP8.
    """
    h = moe_grouped_gemm(
        x,
        w13,
        w13_scale,
        meta["counts"],
        row_ids=meta["row_ids"],
        route_w=meta["route_w"],
        swiglu_limit=swiglu_limit,
        out_dtype=torch.float8_e4m3fn if prequantize else torch.bfloat16,
    )
    y = moe_grouped_gemm(h, w2, w2_scale, meta["counts"])
    assert isinstance(y, torch.Tensor)  # bf16 output: not the FP8 pair
    return moe_combine(y, meta["slot_of"], shared_last, live=live, width=width)


# ---------------------------------------------------------------- MoE: router


def moe_router(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float,
    bias_vl: torch.Tensor | None = None,
    image: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] → (fp32 weights [T, k], int32 experts [T, k]); model/deepseek_v41/moe.py's ``route``.

    s = sqrt(softplus(x · gateᵀ)) in fp32; top-k of s + bias (lower id first among ties, best
    first); weights = s_sel / (Σ s_sel + 1e-20) · route_scale. ``image`` bool [T] with ``bias_vl`` [E]:
    those tokens add ``bias_vl`` instead.
    """
    scores = torch.sqrt(F.softplus(x.float() @ gate_weight.float().t()))
    if image is not None:
        bias = torch.where(image.unsqueeze(-1), bias_vl.float(), bias.float())  # [T, E]
    experts = torch.sort(scores + bias.float(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    picked = scores.gather(-1, experts)
    weights = picked / (picked.sum(-1, keepdim=True) + 1e-20) * route_scale
    return weights, experts.to(torch.int32)
