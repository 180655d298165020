"""One backbone layer (also one DSpark draft stage): Engram, attention and MoE between their
hyper-connection sites (spec §3.1).

    h ← Engram(h)                          (Engram layers only)
    mixA = Mix(h; hc_attn);  a = Attn(attn_norm(Collapse(h, pre)));  h ← Expand(a, h, mixA)
    mixF = Mix(h; hc_ffn);   f = MoE(ffn_norm(Collapse(h, mixA.pre))); h ← Expand(f, h, mixF)
    pre ← mixF.pre
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from model.deepseek_v41.attention import Attention, SparseState
from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.engram import Engram
from model.deepseek_v41.mhc import HyperConnection
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.norm import RMSNorm


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg, layer)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn = MoE(cfg)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)
        engram_ids = list(cfg.engram_layer_ids)
        self.engram_index = engram_ids.index(layer) if layer in engram_ids else None
        self.engram = Engram(cfg, cfg.engram_num_embeddings[self.engram_index]) if layer in engram_ids else None

    def forward(
        self,
        h: torch.Tensor,
        pre: torch.Tensor,
        positions: torch.Tensor,
        state: SparseState,
        engram_rows: torch.Tensor | None,
        live: torch.Tensor | None,
        image: torch.Tensor | None = None,
        taps: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, SparseState]:
        """h [B, S, n, D], pre fp32 [B, S, n] → (h, next pre, state); ``image`` [B, S] bool marks image-span
        tokens; ``taps`` as in ``run``."""
        published = [state]

        def attend(x: torch.Tensor) -> torch.Tensor:
            out, published[0] = self.attn(x, positions, published[0])
            return out

        h, pre = self.run(h, pre, attend, engram_rows, live, image=image, taps=taps)
        return h, pre, published[0]

    def run(
        self,
        h: torch.Tensor,
        pre: torch.Tensor,
        attend: Callable[[torch.Tensor], torch.Tensor],
        engram_rows: torch.Tensor | None,
        live: torch.Tensor | None,
        expert_counts: torch.Tensor | None = None,
        image: torch.Tensor | None = None,
        taps: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer around its attention: ``attend`` maps attn_norm output [B, S, D] → [B, S, D]
        (the full-sequence attention, or a cached engine's). ``engram_rows`` [B, S, L, heads] for
        every Engram layer; ``expert_counts`` int64 [E] gains this layer's routed tokens; ``image``
        [B, S] bool (None: none) routes those tokens with ``bias_vl``. Dead tokens are not ``live``.
        ``taps``, when given, gains the mean over streams of the streams entering the attention mixer
        (after Engram), fp32 [B, S, D]: the DSpark draft's target feature (spec §3.12)."""
        if self.engram is not None:
            h = self.engram(h, engram_rows[:, :, self.engram_index], live)
        if taps is not None:
            taps.append(h.float().mean(2))
        mix_a, x = self.hc_attn.mix_collapse(h, pre)
        h, mix_f, x = self.hc_ffn.expand_mix_collapse(attend(self.attn_norm(x)), h, mix_a)
        # ``image`` only when some token is one (MoE and KernelMoE take it): a text step calls the ffn as before.
        f = (
            self.ffn(self.ffn_norm(x), expert_counts)
            if image is None
            else self.ffn(self.ffn_norm(x), expert_counts, image=image)
        )
        h = self.hc_ffn.expand(f, h, mix_f)
        return h, mix_f.pre
