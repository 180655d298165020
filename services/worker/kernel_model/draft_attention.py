"""The DSpark draft's block attention on ``kernels.draft_attention``: ``DraftAttention``'s interface and
maths, with the RoPE of the queries and own keys, the own keys' FP8 rounding, the softmax over the window
and the block, and the inverse RoPE in one launch per stage (the torch form: about 40 ops).

The projections around it are the stage's own (converted by ``convert_model``: ``KernelLinear``,
``KernelRMSNorm``, ``GroupedKernelLinear``); the queries and the K=V latent go into the kernel before RoPE
(``Attention.query_latent`` then ``query_heads``, and ``Attention.kv_latent``), and its output, RoPE undone,
into ``Attention.project``.
"""

from __future__ import annotations

import torch
from torch import nn

from model.deepseek_v41.attention import Attention
from services.worker.kernel_model.kernel_set import KernelSet


class KernelDraftAttention(nn.Module):
    def __init__(self, kernels: KernelSet) -> None:
        super().__init__()
        self.kernels = kernels

    def forward(
        self, attn: Attention, x: torch.Tensor, turns: torch.Tensor, window: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """As ``DraftAttention.forward``: x [B, T = A·bs, D], turns complex64 [B, T, P], window [B, A, W, hd],
        visible bool [B, A, W] → [B, T, D]."""
        b, a, w, hd = window.shape
        t = x.shape[1]
        bs = t // a
        q = attn.query_heads(attn.query_latent(x))  # [B, T, H, hd], not rotated
        own = attn.kv_latent(x)  # [B, T, hd], not rotated nor rounded
        out = self.kernels.draft_attention.draft_attention(
            q.reshape(b * a, bs, attn.num_heads, hd),
            own.reshape(b * a, bs, hd),
            window.reshape(b * a, w, hd),
            visible.reshape(b * a, w),
            torch.view_as_real(turns).reshape(b * a, bs, turns.shape[-1], 2),
            attn.attn_sink,
            attn.head_dim**-0.5,
        )  # [B·A, bs, H, hd], RoPE undone
        return attn.project(out.view(b, t, attn.num_heads, hd))
