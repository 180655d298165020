"""Mixture of experts, in every layer (spec §3.9).

Router: s = sqrt(softplus(gate · x)) in fp32; the top-k of s + bias selects experts (the bias
never weights them); weights = s_sel / Σ s_sel · routed_scale. Each expert (and the always-on
shared expert) is SwiGLU with clamps: w2(silu(min(w1 x, L)) ⊙ clamp(w3 x, −L, L)). A token's output
sums in fp32, shared expert first, then its routed experts in top-k order: the order every backend
uses, so no combine depends on which other tokens chose an expert.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.indexer import top_indices


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """silu(min(gate, L)) · clamp(up, −L, L) in fp32."""
    return F.silu(gate.float().clamp(max=limit)) * up.float().clamp(min=-limit, max=limit)


class MoE(nn.Module):
    """Router ``gate_weight`` [E, D] with fp32 ``gate_bias``/``bias_vl`` [E]; experts stacked
    ``w1``/``w3`` [E, I, D], ``w2`` [E, D, I]; shared expert ``shared_w1``/``shared_w3`` [I, D],
    ``shared_w2`` [D, I]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.top_k = cfg.num_experts_per_tok
        self.route_scale = cfg.routed_scaling_factor
        self.limit = cfg.swiglu_limit
        self.gate_weight = nn.Parameter(torch.zeros(e, d))
        self.gate_bias = nn.Parameter(torch.zeros(e))
        self.bias_vl = nn.Parameter(torch.zeros(e))  # selection bias for image-span tokens
        self.w1 = nn.Parameter(torch.zeros(e, i, d))
        self.w2 = nn.Parameter(torch.zeros(e, d, i))
        self.w3 = nn.Parameter(torch.zeros(e, i, d))
        self.shared_w1 = nn.Parameter(torch.zeros(i, d))
        self.shared_w2 = nn.Parameter(torch.zeros(d, i))
        self.shared_w3 = nn.Parameter(torch.zeros(i, d))

    def route(self, x: torch.Tensor, image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] → (weights fp32 [T, k], expert ids [T, k]); ties go to the lower expert id.
        ``image`` [T] bool: those tokens select with ``bias_vl`` instead of ``gate_bias``."""
        scores = torch.sqrt(F.softplus(F.linear(x.float(), self.gate_weight.float())))  # [T, E]
        bias = self.gate_bias.float()
        if image is not None:
            bias = torch.where(image.unsqueeze(-1), self.bias_vl.float(), bias)  # [T, E]
        experts = top_indices(scores + bias, self.top_k)  # [T, k]
        weights = scores.gather(-1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.route_scale
        return weights, experts

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor | None = None, image: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, S, D] → [B, S, D]; ``counts`` int64 [E], when given, gains the tokens routed to each expert;
        ``image`` [B, S] bool marks image-span tokens (None: none)."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        weights, experts = self.route(x, None if image is None else image.reshape(-1))
        if counts is not None:
            counts += torch.bincount(experts.flatten(), minlength=counts.numel())
        shared = clamped_swiglu(F.linear(x, self.shared_w1), F.linear(x, self.shared_w3), self.limit).to(x.dtype)
        routed = torch.zeros(*experts.shape, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, k, D]
        for e in experts.unique().tolist():
            tok, slot = torch.where(experts == e)
            xe = x[tok]  # [t, D]
            act = clamped_swiglu(xe @ self.w1[e].t(), xe @ self.w3[e].t(), self.limit)  # [t, I]
            act = (act * weights[tok, slot, None]).to(x.dtype)
            routed[tok, slot] = (act @ self.w2[e].t()).float()
        # The combine, in fp32 and one fixed order: the shared expert, then the routed ones in top-k order.
        out = F.linear(shared, self.shared_w2).float()
        for j in range(experts.shape[-1]):
            out = out + routed[:, j]
        out = out.to(x.dtype)
        return out.reshape(shape)
