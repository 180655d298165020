"""MoE router: sqrt-softplus scores, top-k of score + bias (lower expert id among ties), weights
renormalised over the picks × route_scale (model/deepseek_v41/moe.py ``route``; spec §3.9).

One program routes BLOCK_T tokens: the [BLOCK_T, E] logits x · gateᵀ are accumulated in fp32 over
BLOCK_D-wide steps, then k rounds of arg-max pick the experts. With an image mask (``image`` [T] bool),
the marked tokens select with ``bias_vl`` instead of ``bias`` (image-span tokens; moe.py ``route``);
without one the kernel is compiled as before (``HAS_IMAGE`` constexpr), so text routing is unchanged. Routing must not
flip on rounding, so the tensor cores run the 3-pass tf32 split (fp32-accurate products; exact for bf16 operands,
whose 8 significant bits fit tf32's 11). Reference: ``kernels.reference.moe_router``.

With few token tiles (decode: one program at T ≤ 16 read the whole fp32 gate, 983 KB at v41, alone;
docs/performance.md, "Kernels") the D range is split over ``split`` programs per tile, whose partial logits go to
an fp32 buffer; the tile's last program to finish (a ticket, kernels/tickets.py) adds them in split order
(deterministic) and routes, in the same launch (``one_launch``; else a finishing kernel does, with the same
code and so the same bits). Graph-safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import invariance
from kernels.device import num_sms
from kernels.moe_layout import MAX_TOKENS as LAYOUT_MAX_TOKENS
from kernels.moe_layout import (
    _layout,
    layout_block_t,
    layout_outputs,
    moe_layout,  # noqa: F401 - re-exported: the step's layout after routing
)
from kernels.tickets import tickets


@triton.jit
def _softplus(x):
    """log(1 + e^x) like torch (x itself above 20), with log1p's accuracy for very negative x."""
    y = tl.exp(tl.minimum(x, 20.0))
    u = 1.0 + y
    # log(u) − ((u − 1) − y)/u corrects the rounding of 1 + y (u == 1 means log1p(y) ≈ y).
    log1p = tl.where(u == 1.0, y, tl.log(u) - ((u - 1.0) - y) / u)
    return tl.where(x > 20.0, x, log1p)


@triton.jit
def _route(
    logits,
    tokens,
    t_ok,
    cols,
    e_ok,
    bias_ptr,
    bias_vl_ptr,
    image_ptr,
    weights_ptr,
    experts_ptr,
    route_scale,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
):
    """Logits [BLOCK_T, BLOCK_E] fp32 → the picks and their renormalised weights, stored. HAS_IMAGE:
    tokens whose ``image`` byte is nonzero add ``bias_vl`` instead of ``bias``."""
    scores = tl.sqrt(_softplus(logits))
    bias = tl.load(bias_ptr + cols, mask=e_ok, other=0.0).to(tl.float32)
    if HAS_IMAGE:
        bias_vl = tl.load(bias_vl_ptr + cols, mask=e_ok, other=0.0).to(tl.float32)
        image = tl.load(image_ptr + tokens, mask=t_ok, other=0) != 0
        biased = scores + tl.where(image[:, None], bias_vl[None, :], bias[None, :])
    else:
        biased = scores + bias[None, :]
    # Padded expert columns can never be picked (E ≥ TOP_K is checked by the launcher).
    biased = tl.where(e_ok[None, :], biased, float("-inf"))
    slots = tl.arange(0, BLOCK_K)
    picked = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for i in tl.static_range(TOP_K):
        best = tl.argmax(biased, axis=1, tie_break_left=True)  # lowest id among equal maxima
        hit = cols[None, :] == best[:, None]
        score = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        picked = tl.where(slots[None, :] == i, score[:, None], picked)
        chosen = tl.where(slots[None, :] == i, best[:, None], chosen)
        biased = tl.where(hit, float("-inf"), biased)
    weights = picked / (tl.sum(picked, axis=1) + 1e-20)[:, None] * route_scale
    out_mask = t_ok[:, None] & (slots[None, :] < TOP_K)
    offsets = tokens[:, None].to(tl.int64) * TOP_K + slots[None, :]
    tl.store(weights_ptr + offsets, weights, mask=out_mask)
    tl.store(experts_ptr + offsets, chosen, mask=out_mask)


@triton.jit
def _logits(
    x_ptr,
    gate_ptr,
    tokens,
    t_ok,
    cols,
    e_ok,
    x_row_stride,
    d_first,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    TILES: tl.constexpr,
):
    """x · gateᵀ over D tiles d_first … d_first + TILES − 1, fp32 [BLOCK_T, BLOCK_E]."""
    offs_d = tl.arange(0, BLOCK_D)
    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for i in range(TILES):  # constexpr trip count (the interpreter wants host ints)
        d0 = (d_first + i) * BLOCK_D
        d_ok = d0 + offs_d < D
        x = tl.load(
            x_ptr + tokens[:, None].to(tl.int64) * x_row_stride + d0 + offs_d[None, :],
            mask=t_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        g = tl.load(gate_ptr + cols[None, :] * D + d0 + offs_d[:, None], mask=e_ok[None, :] & d_ok[:, None], other=0.0)
        logits += tl.dot(x.to(tl.float32), g.to(tl.float32), input_precision="tf32x3")
    return logits


@triton.jit
def _summed_splits(
    part_ptr,
    tokens,
    t_ok,
    cols,
    num_tokens,
    SPLIT: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    FROM_L2: tl.constexpr,
):
    """Σ_s part[s] over a token tile, fp32 [BLOCK_T, BLOCK_E], in split order: the sum does not depend on
    the schedule. FROM_L2: read at L2 (".cg"), for partials other programs of this launch wrote."""
    logits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
    for split in range(SPLIT):
        rows = (split * num_tokens + tokens).to(tl.int64)
        ptrs = part_ptr + rows[:, None] * BLOCK_E + cols[None, :]
        if FROM_L2:
            logits += tl.load(ptrs, mask=t_ok[:, None], other=0.0, cache_modifier=".cg")
        else:
            logits += tl.load(ptrs, mask=t_ok[:, None], other=0.0)
    return logits


@triton.jit(do_not_specialize=("num_tokens",))
def _router_kernel(
    x_ptr,
    gate_ptr,
    bias_ptr,
    bias_vl_ptr,
    image_ptr,
    weights_ptr,
    experts_ptr,
    part_ptr,
    ticket_ptr,
    live_ptr,
    counts_ptr,
    row_ids_ptr,
    route_w_ptr,
    slot_of_ptr,
    active_ptr,
    num_active_ptr,
    expert_counts_ptr,
    num_tokens,
    x_row_stride,
    route_scale,
    D: tl.constexpr,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_K: tl.constexpr,
    TILES: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
    FINISH: tl.constexpr,
    LAYOUT: tl.constexpr,
    L_E_PAD: tl.constexpr,
    L_BLOCK_T: tl.constexpr,
    LIVE: tl.constexpr,
    COUNT: tl.constexpr,
):
    """Grid (token tiles, SPLIT). SPLIT 1: logits and routing in one program; else this split's
    partial logits to part [SPLIT, T, BLOCK_E], and with FINISH the tile's last program (ticket
    [token tiles] int32) sums them and routes (else ``_router_finish_kernel`` does: the same code).
    LAYOUT (one token tile): the program that routed then lays out the step's MoE (``moe_layout._layout``
    over its own stores of weights and experts, after a barrier; live, counts … expert_counts as there)."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    cols = tl.arange(0, BLOCK_E)
    e_ok = cols < E
    split = tl.program_id(1)
    logits = _logits(
        x_ptr, gate_ptr, tokens, t_ok, cols, e_ok, x_row_stride, split * TILES, D, BLOCK_T, BLOCK_E, BLOCK_D, TILES
    )
    if SPLIT == 1:
        _route(
            logits,
            tokens,
            t_ok,
            cols,
            e_ok,
            bias_ptr,
            bias_vl_ptr,
            image_ptr,
            weights_ptr,
            experts_ptr,
            route_scale,
            TOP_K,
            BLOCK_T,
            BLOCK_K,
            HAS_IMAGE,
        )
        if LAYOUT:
            tl.debug_barrier()  # every thread's picks stored and visible to the block
            _layout(
                experts_ptr,
                weights_ptr,
                live_ptr,
                counts_ptr,
                row_ids_ptr,
                route_w_ptr,
                slot_of_ptr,
                active_ptr,
                num_active_ptr,
                expert_counts_ptr,
                num_tokens,
                E,
                TOP_K,
                BLOCK_K,
                L_E_PAD,
                L_BLOCK_T,
                1024,
                LIVE,
                COUNT,
            )
    else:
        rows = (split * num_tokens + tokens).to(tl.int64)
        tl.store(part_ptr + rows[:, None] * BLOCK_E + cols[None, :], logits, mask=t_ok[:, None])
        if FINISH:
            # Every thread's partials are stored before the ticket is taken (the barrier), and released with
            # it; the last program's acquire makes all SPLIT partials visible to it (kernels/tickets.py).
            tl.debug_barrier()
            ticket = tl.atomic_add(ticket_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT - 1:
                total = _summed_splits(part_ptr, tokens, t_ok, cols, num_tokens, SPLIT, BLOCK_T, BLOCK_E, True)
                _route(
                    total,
                    tokens,
                    t_ok,
                    cols,
                    e_ok,
                    bias_ptr,
                    bias_vl_ptr,
                    image_ptr,
                    weights_ptr,
                    experts_ptr,
                    route_scale,
                    TOP_K,
                    BLOCK_T,
                    BLOCK_K,
                    HAS_IMAGE,
                )
                if LAYOUT:
                    tl.debug_barrier()  # every thread's picks stored and visible to the block
                    _layout(
                        experts_ptr,
                        weights_ptr,
                        live_ptr,
                        counts_ptr,
                        row_ids_ptr,
                        route_w_ptr,
                        slot_of_ptr,
                        active_ptr,
                        num_active_ptr,
                        expert_counts_ptr,
                        num_tokens,
                        E,
                        TOP_K,
                        BLOCK_K,
                        L_E_PAD,
                        L_BLOCK_T,
                        1024,
                        LIVE,
                        COUNT,
                    )
                tl.store(ticket_ptr + tl.program_id(0), 0)  # 0 again for the next launch or graph replay


@triton.jit(do_not_specialize=("num_tokens",))
def _router_finish_kernel(
    part_ptr,
    bias_ptr,
    bias_vl_ptr,
    image_ptr,
    weights_ptr,
    experts_ptr,
    num_tokens,
    route_scale,
    E: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = tokens < num_tokens
    cols = tl.arange(0, BLOCK_E)
    e_ok = cols < E
    logits = _summed_splits(part_ptr, tokens, t_ok, cols, num_tokens, SPLIT, BLOCK_T, BLOCK_E, False)
    _route(
        logits,
        tokens,
        t_ok,
        cols,
        e_ok,
        bias_ptr,
        bias_vl_ptr,
        image_ptr,
        weights_ptr,
        experts_ptr,
        route_scale,
        TOP_K,
        BLOCK_T,
        BLOCK_K,
        HAS_IMAGE,
    )


def default_split(num_token_tiles: int, num_d_tiles: int, num_programs: int) -> int:
    """D splits per token tile: enough programs for about ``num_programs``, each with ≥ 2 D tiles
    (a split also costs a partial-logits round trip and a finishing launch)."""
    if num_token_tiles >= num_programs // 2:
        return 1
    return max(1, min(num_d_tiles // 2, num_programs // num_token_tiles))


def moe_router(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float,
    split: int | None = None,
    bias_vl: torch.Tensor | None = None,
    image: torch.Tensor | None = None,
    *,
    one_launch: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] → (fp32 weights [T, k], int32 experts [T, k], best first); gate_weight [E, D], bias [E].
    ``split``: programs per token tile over D (None: ``default_split``; 1: one program per tile).
    ``image`` bool [T] with ``bias_vl`` [E] (both or neither): the marked tokens select with ``bias_vl``.
    ``one_launch`` False: split partials routed by a second launch (the same bits; kept to test against)."""
    weights, experts, _ = _launch(x, gate_weight, bias, top_k, route_scale, split, bias_vl, image, one_launch, None)
    return weights, experts


def moe_router_layout(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float,
    live: torch.Tensor | None = None,
    expert_counts: torch.Tensor | None = None,
    split: int | None = None,
    bias_vl: torch.Tensor | None = None,
    image: torch.Tensor | None = None,
    *,
    one_launch: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """``moe_router`` and then ``moe_layout(experts, weights, E, live, expert_counts)``: (weights, experts, the
    layout's metadata). Up to one token tile (16 rows) the program that routes the tile lays it out too, in
    the router's launch (the layout's code, so its bytes); above, the layout is a launch of its own."""
    num_tokens = x.shape[0]
    if num_tokens > LAYOUT_MAX_TOKENS:
        raise ValueError(f"{num_tokens} tokens: the layout is for decode steps of at most {LAYOUT_MAX_TOKENS}")
    if live is not None and (live.shape != (num_tokens,) or live.dtype != torch.bool):
        raise ValueError(f"live must be bool [{num_tokens}], got {live.dtype} {tuple(live.shape)}")
    if expert_counts is not None and expert_counts.shape != (gate_weight.shape[0],):
        raise ValueError(f"expert_counts must be [{gate_weight.shape[0]}], got {tuple(expert_counts.shape)}")
    layout = (live, expert_counts) if num_tokens <= ROUTER_BLOCK_T else None
    weights, experts, meta = _launch(
        x, gate_weight, bias, top_k, route_scale, split, bias_vl, image, one_launch, layout
    )
    if meta is None:
        meta = moe_layout(experts, weights, gate_weight.shape[0], live, expert_counts)
    return weights, experts, meta


ROUTER_BLOCK_T = 16
"""Tokens per router program (one tile: the rows of the [BLOCK_T, E] logits' MMA)."""


def _launch(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    route_scale: float,
    split: int | None,
    bias_vl: torch.Tensor | None,
    image: torch.Tensor | None,
    one_launch: bool,
    layout: tuple[torch.Tensor | None, torch.Tensor | None] | None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None]:
    """The router launch(es); with ``layout`` = (live, expert_counts) and one token tile, the layout in the
    routing program too (its metadata returned; None when not laid out here)."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    if gate_weight.shape != (num_experts, hidden) or bias.shape != (num_experts,):
        raise ValueError(f"gate {tuple(gate_weight.shape)} / bias {tuple(bias.shape)} do not fit x {tuple(x.shape)}")
    if (image is None) != (bias_vl is None):
        raise ValueError("image and bias_vl go together: pass both or neither")
    if image is not None and (
        image.shape != (num_tokens,) or image.dtype != torch.bool or bias_vl.shape != (num_experts,)
    ):
        raise ValueError(
            f"image {tuple(image.shape)} {image.dtype} / bias_vl {tuple(bias_vl.shape)} do not fit "
            f"x {tuple(x.shape)} and {num_experts} experts (image must be bool [T])"
        )
    has_image = image is not None
    image_bytes = image.contiguous().view(torch.uint8) if has_image else bias  # unread without HAS_IMAGE
    bias_vl = bias_vl if has_image else bias
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, {num_experts}]")
    if x.stride(-1) != 1:
        x = x.contiguous()
    gate_weight = gate_weight.contiguous()
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    experts = torch.empty(num_tokens, top_k, dtype=torch.int32, device=x.device)
    block_t, block_d = ROUTER_BLOCK_T, 128
    block_e, block_k = max(16, triton.next_power_of_2(num_experts)), triton.next_power_of_2(top_k)
    num_t_tiles, num_d_tiles = triton.cdiv(num_tokens, block_t), triton.cdiv(hidden, block_d)
    if split is None and invariance.active():
        split = invariance.ROUTER_SPLITS  # a function of nothing in the batch (kernels/invariance.py)
    if split is None:  # from the token tiles' power of two: SPLIT and TILES are constexprs, few values over all T
        split = default_split(triton.next_power_of_2(num_t_tiles), num_d_tiles, num_sms(x.device, off_gpu=8))
    split = max(1, min(split, num_d_tiles))
    tiles = triton.cdiv(num_d_tiles, split)  # the last split may run past D: masked
    part = torch.empty(split if split > 1 else 0, num_tokens, block_e, dtype=torch.float32, device=x.device)
    ticket = tickets("moe_router", x.device, num_t_tiles) if split > 1 and one_launch else part  # unread else
    # The layout where one program routes every token: one tile, routed by its only or its last program.
    here = layout is not None and num_t_tiles == 1 and (split == 1 or one_launch)
    live, expert_counts = layout if here else (None, None)
    meta = layout_outputs(num_tokens, top_k, num_experts, x.device) if here else None
    out = meta or {}
    _router_kernel[(num_t_tiles, split)](
        x,
        gate_weight,
        bias,
        bias_vl,
        image_bytes,
        weights,
        experts,
        part,
        ticket,
        live.contiguous() if live is not None else weights,  # bool: loaded as i1; unread without LIVE
        *(out.get(key, weights) for key in ("counts", "row_ids", "route_w", "slot_of", "active", "num_active")),
        expert_counts if expert_counts is not None else weights,  # unread without COUNT
        num_tokens,
        x.stride(0),
        float(route_scale),
        D=hidden,
        E=num_experts,
        TOP_K=top_k,
        BLOCK_T=block_t,
        BLOCK_E=block_e,
        BLOCK_D=block_d,
        BLOCK_K=block_k,
        TILES=tiles,
        SPLIT=split,
        HAS_IMAGE=has_image,
        FINISH=one_launch,
        LAYOUT=here,
        L_E_PAD=triton.next_power_of_2(num_experts + 1),
        L_BLOCK_T=layout_block_t(top_k, num_experts),
        LIVE=live is not None,
        COUNT=expert_counts is not None,
        num_warps=4,
        num_stages=3,
    )
    if split > 1 and not one_launch:
        _router_finish_kernel[(num_t_tiles,)](
            part,
            bias,
            bias_vl,
            image_bytes,
            weights,
            experts,
            num_tokens,
            float(route_scale),
            E=num_experts,
            TOP_K=top_k,
            BLOCK_T=block_t,
            BLOCK_E=block_e,
            BLOCK_K=block_k,
            SPLIT=split,
            HAS_IMAGE=has_image,
            num_warps=4,
        )
    return weights, experts, meta
