"""The DSpark draft's block attention (spec §3.12), the torch reference a kernel backend swaps out.

A block of bs slots at positions anchor … anchor+bs−1 attends, through one stage's ``Attention`` (its wq,
wkv, sink and wo, the main RoPE), over its W context entries (the window, oldest first; hidden where not
``visible``) and then its own bs slots, bidirectionally. The own keys are the stage's ``window_kv`` of the
block (rotated, FP8-rounded), as the window's entries were when written. Every block attends over this one
key layout, so the cached and the full-sequence drafts reduce in the same order.

A module of its own (no weights: the stage's are passed in) so that ``convert_model`` can replace it
(services/worker/kernel_model/draft_attention.py: one launch per stage for the queries' and keys' RoPE, the own
keys' FP8 rounding, the softmax and the inverse RoPE).
"""

from __future__ import annotations

import torch
from torch import nn

from model.deepseek_v41.attention import Attention, sink_attention


class DraftAttention(nn.Module):
    def forward(
        self, attn: Attention, x: torch.Tensor, turns: torch.Tensor, window: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """x [B, T = A·bs, D] (the stage's attn_norm output), turns complex64 [B, T, P] (``rope_turns`` of the
        slots' positions), window [B, A, W, hd] (each block's context K=V), visible bool [B, A, W] → [B, T, D]."""
        b, a = window.shape[:2]
        bs = x.shape[1] // a
        _, q = attn.queries(x, turns)  # [B, T, H, hd]
        own = attn.window_kv(x, turns).unflatten(1, (a, bs))  # [B, A, bs, hd]
        keys = torch.cat((window.to(own.dtype), own), dim=2).flatten(0, 1)  # [B·A, W + bs, hd]
        allowed = torch.cat((visible, visible.new_ones(b, a, bs)), dim=-1)  # [B, A, W + bs]
        allowed = allowed.flatten(0, 1).unsqueeze(1).expand(-1, bs, -1)  # [B·A, bs, W + bs]
        out = sink_attention(
            q.unflatten(1, (a, bs)).flatten(0, 1), keys, allowed, attn.attn_sink, attn.head_dim**-0.5
        )  # [B·A, bs, H, hd]
        return attn.project_out(out.unflatten(0, (b, a)).flatten(1, 2), turns)
