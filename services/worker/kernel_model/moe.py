"""Kernel-backed RMSNorm and MoE modules: drop-in replacements for ``model.deepseek_v41``'s.

``KernelMoE`` routes with ``kernels.moe_router`` and runs the routed experts and the shared expert in
one masked grouped GEMM pair (``kernels.moe_grouped_gemm.moe_experts``; the shared expert in launches of
its own where its rows span several M tiles), or, for big eager prefill steps, expert by expert through
cuBLASLt's block-scaled GEMM on the same layout (services/worker/kernel_model/block_scaled_experts.py says when), or,
where ``deep_gemm`` is installed and its probe passes (and ``SHINKAI_MOE_GEMM`` is not ``triton``), eager steps of at
least ``deepgemm_moe.MIN_TOKENS`` rows (prefill) through DeepGEMM's grouped FP8 GEMMs (kernels/deepgemm_moe.py;
docs/performance.md has the measurements); with
``SHINKAI_MOE_SPLITK=1``, decode's few rows take the K-split grouped GEMM where its shape rule says
(kernels/moe_splitk.py; not the default until timed). Both flags are read when the module is built. The
shared expert is stacked as expert E and every token picks it with weight 1, which is exactly the model's sum
``shared + routed`` (the model applies no weight to the shared expert); the combine adds the shared
expert first, then the routed picks in top-k order, in fp32, as the model does. Only the routed picks are
added to ``counts``, as ``model/deepseek_v41/moe.py`` does.

``live`` (a row mask, for the static decode step's placeholder rows: services/worker/runners/static_decode_step.py)
routes the other rows nowhere: their choices go to sink experts past the stacked ones, which the
layout then drops, so they take no slot, activate no expert, count towards nothing and come out
as zeros. ``image`` (a row mask of image-span tokens) has those rows select their experts with the
gate's ``bias_vl`` instead of ``gate_bias``, as the model's MoE does; without it the router runs exactly
as for text. Device ops only on the grouped path (the block-scaled one reads the expert counts on the
host, and is eager only), so a CUDA graph captures it with the mask's values left to each replay.
Up to ``LAYOUT_MAX_TOKENS`` rows the layout and the counts are one launch (``kernels/moe_layout.py``), and
up to one router tile (16 rows) they are part of the router's launch (``moe_router.moe_router_layout``);
``_layout`` is the same layout in torch (bigger steps, and kernel sets without it).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from kernels import deepgemm_moe, invariance
from kernels.fp8_weights import stack_gate_up
from kernels.reference import route_metadata
from model.deepseek_v41.moe import MoE, clamped_swiglu
from model.deepseek_v41.norm import RMSNorm
from services.worker.kernel_model import block_scaled_experts, block_scaled_gemm
from services.worker.kernel_model.fp4_experts import EXPERT_FORMATS, Fp4Experts
from services.worker.kernel_model.fp8_linear import PRECISIONS, pad_last, pad_matrix, quantize_each, round_up
from services.worker.kernel_model.kernel_set import KernelSet


class KernelRMSNorm(nn.Module):
    """``kernels.rmsnorm`` (fp32 maths, output in x's dtype) with the model module's weight and eps."""

    def __init__(self, norm: RMSNorm, kernels: KernelSet) -> None:
        super().__init__()
        self.eps, self.kernels = norm.eps, kernels
        self.weight = nn.Parameter(norm.weight.detach().float().clone(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., C] → [..., C]
        return self.kernels.rmsnorm.rmsnorm(x, self.weight, self.eps)  # it reads rows at their stride

    def rope_fits(self, x: torch.Tensor, turns: torch.Tensor, q: torch.Tensor) -> bool:
        """Whether ``forward_rope`` takes these: a kernel set with ``rmsnorm_rope``, fp32 x [R, C] and
        q [R, H, Dq] (last dims contiguous), complex64 turns [R, P] (``rope_turns``)."""
        return (
            hasattr(self.kernels.rmsnorm, "rmsnorm_rope")
            and x.dtype == q.dtype == torch.float32
            and turns.dtype == torch.complex64
            and x.ndim == 2
            and q.ndim == 3
            and turns.ndim == 2
            and x.stride(-1) == 1
            and q.stride(-1) == 1
            and x.shape[0] == q.shape[0] == turns.shape[0]
        )

    def forward_rope(self, x: torch.Tensor, turns: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """``apply_rope_(self(x), turns)``, with ``apply_rope_(q, turns)`` done in place, in one launch (the
        same bits on the CPU: kernels/rmsnorm.py). Only where ``rope_fits``."""
        return self.kernels.rmsnorm.rmsnorm_rope(x, self.weight, self.eps, turns, q)


MOE_MAX_TOKENS = 8192
"""Tokens per pass of ``KernelMoE``: the masked layout gives each of the E+1 experts T slots, so one
32K-token prefill step needed [49, 32768, 5120] bf16 (16 GB) for the down GEMM's output plus a 2.2 GB
gather for the combine, and ran out of memory beside v41-s1's 110 GB of weights (H200; docs/performance.md).
Every token's output depends only on its own row, so passes of this many tokens give the same values."""


class KernelMoE(nn.Module):
    """Router ``gate_weight`` [E, D] + ``gate_bias`` [E] (``bias_vl`` [E] for image-span tokens); experts
    0..E−1 routed, expert E shared.

    fp8: ``w13`` e4m3 [E+1, 2I', D'] (gate rows [0, I'), up rows [I', 2I')) and ``w2`` e4m3 [E+1, D', I'],
    fp32 128×128 block scales, zero-padded to multiples of 128. fp32: the same stacks unpadded, fp32,
    run as batched matmuls over the same masked layout (the GEMM kernel has no fp32-weight mode).
    """

    def __init__(self, moe: MoE, precision: str, kernels: KernelSet, expert_format: str = "fp8") -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        if expert_format not in EXPERT_FORMATS:
            raise ValueError(f"expert_format must be one of {EXPERT_FORMATS}, got {expert_format!r}")
        self.precision, self.kernels = precision, kernels
        self.top_k, self.route_scale, self.limit = moe.top_k, moe.route_scale, moe.limit
        self.num_experts, self.intermediate, self.hidden = moe.w1.shape
        self.gate_weight = nn.Parameter(moe.gate_weight.detach().float().clone(), requires_grad=False)
        self.gate_bias = nn.Parameter(moe.gate_bias.detach().float().clone(), requires_grad=False)
        self.bias_vl = nn.Parameter(moe.bias_vl.detach().float().clone(), requires_grad=False)
        self.inexact = 0
        self.splitk = os.environ.get("SHINKAI_MOE_SPLITK", "0") == "1"  # K-split experts at decode (opt-in)
        self.scale_b: tuple[torch.Tensor, torch.Tensor] | None = None  # w13/w2 scales in cuBLASLt's layout
        # Routed experts kept MXFP4 (fp4_experts.py) with the FP8 backend and a kernel set that has moe_fp4.
        self.fp4: Fp4Experts | None = None
        if precision == "fp8" and expert_format == "fp4" and kernels.moe_fp4 is not None:
            self.fp4 = Fp4Experts(moe, kernels)
            self.inexact = self.fp4.inexact
        elif precision == "fp8":
            # Expert by expert (E routed, then the shared one as expert E): no fp32 copy of the stack.
            def expert(name: str, e: int) -> torch.Tensor:
                w = getattr(moe, name)[e] if e < self.num_experts else getattr(moe, f"shared_{name}")
                return w.detach().float()

            # Gate and up are padded separately, so the kernel's row split at N/2 stays gate | up.
            q13, s13, bad13 = quantize_each(
                self.num_experts + 1, lambda e: stack_gate_up(pad_matrix(expert("w1", e)), pad_matrix(expert("w3", e)))
            )
            q2, s2, bad2 = quantize_each(self.num_experts + 1, lambda e: expert("w2", e))
            self.inexact = bad13 + bad2
            self.register_buffer("w13", q13)
            self.register_buffer("w13_scale", s13)
            self.register_buffer("w2", q2)
            self.register_buffer("w2_scale", s2)
        else:
            w1 = torch.cat((moe.w1.detach(), moe.shared_w1.detach()[None])).float()  # [E+1, I, D]
            w3 = torch.cat((moe.w3.detach(), moe.shared_w3.detach()[None])).float()
            w2 = torch.cat((moe.w2.detach(), moe.shared_w2.detach()[None])).float()  # [E+1, D, I]
            self.register_buffer("w13", stack_gate_up(w1, w3).contiguous())  # fp32 [E+1, 2I, D]
            self.register_buffer("w2", w2.contiguous())

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor | None = None,
        live: torch.Tensor | None = None,
        image: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [B, S, D] → [B, S, D]; ``counts`` int64 [E], when given, gains the tokens routed to each expert.
        ``live`` bool [B, S] (None: every row): rows outside it are routed nowhere and output zeros.
        ``image`` bool [B, S] (None: none) marks image-span tokens, which select with ``bias_vl``."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()  # [T, D]
        if x2.shape[0] > MOE_MAX_TOKENS:
            rows2 = None if live is None else live.reshape(-1)
            image2 = None if image is None else image.reshape(-1)
            parts = [
                self.forward(
                    x2[i : i + MOE_MAX_TOKENS],
                    counts,
                    None if rows2 is None else rows2[i : i + MOE_MAX_TOKENS],
                    None if image2 is None else image2[i : i + MOE_MAX_TOKENS],
                )
                for i in range(0, x2.shape[0], MOE_MAX_TOKENS)
            ]
            return torch.cat(parts).reshape(shape)
        vl = {} if image is None else {"bias_vl": self.bias_vl, "image": image.reshape(-1)}
        router = self.kernels.moe_router
        rows = None if live is None else live.reshape(-1, 1)  # [T, 1]
        if hasattr(router, "moe_router_layout") and x2.shape[0] <= router.LAYOUT_MAX_TOKENS:
            # Routing, then the layout and the counts (kernels/moe_layout.py: the same bytes as ``_layout``): in
            # the router's launch up to one token tile, else in a launch of their own.
            weights, experts, meta = router.moe_router_layout(
                x2,
                self.gate_weight,
                self.gate_bias,
                self.top_k,
                self.route_scale,
                None if rows is None else rows.reshape(-1),
                counts,
                **vl,
            )  # weights, experts [T, k]
        else:
            weights, experts = router.moe_router(
                x2, self.gate_weight, self.gate_bias, self.top_k, self.route_scale, **vl
            )  # [T, k] each
            layout = getattr(router, "moe_layout", None)
            if layout is not None and x2.shape[0] <= router.LAYOUT_MAX_TOKENS:
                meta = layout(experts, weights, self.num_experts, None if rows is None else rows.reshape(-1), counts)
            else:
                if counts is not None:
                    one = (
                        torch.ones_like(experts, dtype=counts.dtype)
                        if rows is None
                        else rows.to(counts.dtype).expand(experts.shape)
                    )
                    counts.scatter_add_(0, experts.flatten().long(), one.flatten())
                meta = self._layout(experts, weights, rows)
        if self.fp4 is not None:
            return (
                self.fp4(x2, meta, None if rows is None else rows.reshape(-1), self.hidden).to(x.dtype).reshape(shape)
            )
        if self.precision == "fp8":
            xp = pad_last(x2, self.w13.shape[-1]).contiguous()  # [T, D']
            if self._deepgemm(xp):
                contiguous = self.kernels.moe_contiguous
                out = deepgemm_moe.experts(
                    xp,
                    meta,
                    self.w13,
                    self.w13_scale,
                    self.w2,
                    self.w2_scale,
                    self.limit,
                    self.kernels.quant_fp8.quantize_act,
                    self.kernels.quant_fp8.swiglu_quant,
                    self.kernels.moe_grouped_gemm.moe_combine,
                    masked=False,
                    layout=None if contiguous is None else contiguous.contiguous_layout,
                )
            elif block_scaled_experts.applies(
                xp.shape[0], self.top_k, self.num_experts, xp.device, self.kernels.interpreted
            ):
                scale_b13, scale_b2 = self._scale_b()
                out = block_scaled_experts.experts(
                    xp,
                    meta,
                    self.w13,
                    scale_b13,
                    self.w2,
                    scale_b2,
                    self.limit,
                    self.kernels.quant_fp8.quantize_act,
                    self.kernels.moe_grouped_gemm.moe_combine,
                )
            else:
                # The combine writes [T, D] and +0.0 in the dead rows: the where below, in the same launch.
                gemm = self.kernels.moe_grouped_gemm
                split = self.splitk and gemm.worth_splitting_experts(meta, self.w13, self.w2)
                out = (gemm.moe_experts_splitk if split else gemm.moe_experts)(
                    xp,
                    meta,
                    self.w13,
                    self.w13_scale,
                    self.w2,
                    self.w2_scale,
                    self.limit,
                    shared_last=True,
                    live=None if rows is None else rows.reshape(-1),
                    width=self.hidden,
                )
                rows = None
            out = out[:, : self.hidden]
        else:
            out = self._experts_fp32(x2, meta)
        if rows is not None:
            out = torch.where(rows, out, 0.0)  # the others gathered slot 0 (any bytes, even NaN)
        return out.to(x.dtype).reshape(shape)

    def _deepgemm(self, xp: torch.Tensor) -> bool:
        """Whether the experts of xp [T, D'] run on DeepGEMM's contiguous layout (kernels/deepgemm_moe.py): not
        refused by ``SHINKAI_MOE_GEMM=triton``, compiled kernels, outside the batch-invariant mode (its tiles follow
        M), an eager step of at least ``deepgemm_moe.MIN_TOKENS`` rows,
        and its probe passed on xp's device. Captured decode stays on the Triton grouped GEMM, whose layer beat
        DeepGEMM's masked one (docs/performance.md)."""
        if not deepgemm_moe.requested() or self.kernels.interpreted or invariance.active():
            return False
        if xp.shape[0] < deepgemm_moe.MIN_TOKENS:
            return False
        capturing = xp.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        return not capturing and deepgemm_moe.available(xp.device)

    def _scale_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The w13 and w2 block scales in cuBLASLt's layout (``block_scaled_gemm.scale_b``), made on first use
        on the weights' device."""
        if self.scale_b is None or self.scale_b[0].device != self.w13.device:
            self.scale_b = (block_scaled_gemm.scale_b(self.w13_scale), block_scaled_gemm.scale_b(self.w2_scale))
        return self.scale_b

    def _layout(
        self, experts: torch.Tensor, weights: torch.Tensor, rows: torch.Tensor | None
    ) -> dict[str, torch.Tensor]:
        """``route_metadata`` over E + 1 stacked experts (expert E, the shared one, picked by every row
        with weight 1). Rows outside ``rows`` [T, 1] pick sink experts E+1 … E+k+1 instead (one each,
        so no sink overflows its T slots); the sinks are then cut off the layout."""
        num_stacked, num_tokens = self.num_experts + 1, experts.shape[0]
        shared = torch.full((num_tokens, 1), self.num_experts, dtype=experts.dtype, device=experts.device)
        choices = torch.cat((experts, shared), 1)  # [T, k+1]
        route_w = torch.cat((weights, torch.ones_like(shared, dtype=weights.dtype)), 1)
        if rows is None:
            return route_metadata(choices, route_w, num_stacked)
        sinks = torch.arange(num_stacked, num_stacked + choices.shape[1], dtype=choices.dtype, device=choices.device)
        meta = route_metadata(
            torch.where(rows, choices, sinks), torch.where(rows, route_w, 0.0), num_stacked + choices.shape[1]
        )
        counts = meta["counts"][:num_stacked]
        return {
            "counts": counts,
            "row_ids": meta["row_ids"][:num_stacked],
            "route_w": meta["route_w"][:num_stacked],
            "slot_of": torch.where(rows, meta["slot_of"], 0),  # the sinks' slots are gone: any slot
            "active": torch.sort((counts == 0).to(torch.int32), stable=True).indices.to(torch.int32),
            "num_active": (counts > 0).sum().to(torch.int32).view(1),
        }

    def _experts_fp32(self, x: torch.Tensor, meta: dict[str, torch.Tensor]) -> torch.Tensor:
        """The masked layout in torch: [E+1, cap, D] gathered rows, SwiGLU · route_w, down, gather-sum → fp32 [T, D]."""
        a = x.float()[meta["row_ids"].long()]  # [E+1, cap, D]; slots ≥ counts hold token 0, never combined
        gate_up = torch.bmm(a, self.w13.transpose(1, 2))  # [E+1, cap, 2I]
        h = clamped_swiglu(gate_up[..., : self.intermediate], gate_up[..., self.intermediate :], self.limit)
        y = torch.bmm(h * meta["route_w"].unsqueeze(-1), self.w2.transpose(1, 2))  # [E+1, cap, D]
        rows, slot_of = y.view(-1, y.shape[-1]), meta["slot_of"]
        out = torch.zeros_like(rows[: slot_of.shape[0]])
        for j in (slot_of.shape[1] - 1, *range(slot_of.shape[1] - 1)):  # the shared expert first, then top-k order
            out = out + rows[slot_of[:, j]]
        return out

    def extra_repr(self) -> str:
        padded = (
            f" (padded to {round_up(self.intermediate)}/{round_up(self.hidden)})" if self.precision == "fp8" else ""
        )
        experts = ", routed experts MXFP4" if self.fp4 is not None else ""
        return (
            f"experts={self.num_experts}+1 shared, top_k={self.top_k}, I={self.intermediate}, D={self.hidden}"
            f"{padded}, precision={self.precision}{experts}"
        )
