"""Compressors of the KV-source layers (spec §3.6).

Ratio 2 pools token pairs (2g, 2g+1) through an fp32 per-channel softmax gate; ratio 1 is an
unpooled projection (its own ``compressor.wkv``, distinct from ``attn.wkv``). A group exists only
once complete. The pre-RoPE latent feeds the indexer keys; the cache entry is the latent rotated
at the group's first position and rounded to FP4 (e4m3 scale per 16 channels).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.norm import RMSNorm
from model.deepseek_v41.quant import fake_quant_compressed_kv
from model.deepseek_v41.rope import apply_rope


class Compressor(nn.Module):
    """``wkv`` [hd, D] (and ``wgate`` [hd, D] for ratio 2), ``norm`` [hd]; weights used in fp32."""

    def __init__(self, cfg: ModelConfig, ratio: int) -> None:
        super().__init__()
        if ratio not in (1, 2):
            raise ValueError(f"compressor ratio must be 1 or 2, got {ratio}")
        self.ratio = ratio
        self.wkv = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False) if ratio == 2 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, S, D] (attention input of tokens 0..S−1) → latent [B, S // ratio, hd], pre-RoPE."""
        if self.ratio == 1:
            return self.norm(F.linear(x, self.wkv.weight.to(x.dtype)))
        length = x.shape[1] // self.ratio * self.ratio  # an incomplete trailing group emits nothing
        values, gates = self.project(x[:, :length])
        return self.pool(values.unflatten(1, (-1, self.ratio)), gates.unflatten(1, (-1, self.ratio)), x.dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Ratio 2: per-token fp32 values and gates, x [..., D] → ([..., hd], [..., hd]) (a cache's partial group)."""
        xs = x.float()
        return F.linear(xs, self.wkv.weight.float()), F.linear(xs, self.wgate.weight.float())

    def pool(self, values: torch.Tensor, gates: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Ratio 2: one group's tokens [..., r, hd] (fp32 values, gates) → normed latent [..., hd] in ``dtype``."""
        pooled = (values * gates.softmax(dim=-2)).sum(dim=-2).to(dtype)
        return self.norm(pooled)


def group_positions(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Position of each complete group's first token: positions [B, S] → [B, S // ratio]."""
    groups = positions.shape[-1] // ratio
    return positions[..., : groups * ratio : ratio]


def compressed_entries(latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Cache entries: RoPE at each group's first token, then FP4 (spec §3.6). [B, G, hd] → [B, G, hd]."""
    return fake_quant_compressed_kv(apply_rope(latent, angles))
