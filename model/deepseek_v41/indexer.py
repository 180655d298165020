"""Two-level sparse selection over compressed entries (spec §3.7).

Keys (KV sources only): ``k_norm(wk · latent)``, compress RoPE at the group's first token, FP4.
Queries (every index source): ``wq_b · c`` from the attention's q latent, RoPE at p, FP4.
Score of entry j for the query at p: Σ_h relu(q_h·k_j) · w_h, with w = weights_proj(x)·(d·H)^−½,
−∞ for entries not yet visible (j ≥ ⌊(p+1)/r⌋).

Level 1 (candidate source): blocks of ``candidate_block_size`` entries scored by their max, the
newest visible block forced in, the top ``candidate_topk_blocks`` finite blocks kept. Index sources
after the candidate source score only inside that mask. Level 2: top-min(k, visible) entries.

Ties are broken towards the lower index everywhere (spec §5.5 leaves the references' order
arbitrary); the selection functions take explicit visible counts so a cached engine can call them
one step at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.norm import RMSNorm
from model.deepseek_v41.quant import fake_quant_indexer
from model.deepseek_v41.rope import apply_rope, apply_rope_


class Indexer(nn.Module):
    """``wq_b`` [Hi·di, q_lora], ``weights_proj`` [Hi, D]; key owners also ``wk`` [di, hd], ``k_norm`` [di]."""

    def __init__(self, cfg: ModelConfig, *, owns_keys: bool) -> None:
        super().__init__()
        self.num_heads = cfg.index_n_heads
        self.head_dim = cfg.index_head_dim
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)
        self.wk = nn.Linear(cfg.head_dim, self.head_dim, bias=False) if owns_keys else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if owns_keys else None

    @property
    def weight_scale(self) -> float:
        """(di·Hi)^-1/2, the factor on ``weights_proj``'s head weights."""
        return self.head_dim**-0.5 * self.num_heads**-0.5

    def keys(self, latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Index keys from the pre-RoPE compressed latent: [B, G, hd] → FP4-rounded [B, G, di]."""
        return fake_quant_indexer(apply_rope(self.k_norm(self.wk(latent)), angles))

    def scores(
        self, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """Entry scores for every query.

        x [B, S, D] attention input; q_latent [B, S, q_lora]; angles [B, S, P] at the query positions;
        keys [B, W, di]; visible [B, S] int count of visible entries. Returns fp32 [B, S, W], −∞ where hidden.
        """
        return self.scores_quantized(fake_quant_indexer(self.query(q_latent, angles)), x, keys, visible)

    def query(self, q_latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Rotated, not yet FP4-rounded queries: q_latent [..., q_lora], angles [..., P] → [..., Hi, di]."""
        # In place: wq_b's output is this call's own tensor (``apply_rope_`` writes apply_rope's bits).
        return apply_rope_(self.wq_b(q_latent).unflatten(-1, (self.num_heads, self.head_dim)), angles)

    def scores_quantized(
        self, q: torch.Tensor, x: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """``scores`` from FP4-rounded queries q [B, S, Hi, di]; the other arguments as there."""
        w = self.weights_proj(x) * self.weight_scale  # [B, S, Hi]
        s = torch.einsum("bshd,btd->bsht", q, keys)  # [B, S, Hi, W]
        s = (s.relu() * w.unsqueeze(-1)).sum(dim=2)  # [B, S, W]
        hidden = torch.arange(keys.shape[1], device=x.device) >= visible.unsqueeze(-1)
        return s.masked_fill(hidden, -torch.inf)


def visible_entries(positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """Compressed entries visible to the query at p: ⌊(p+1)/ratio⌋ (a group shows once complete)."""
    return (positions + 1) // ratio


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The k best columns of [..., W], best first, lower index first among equal scores: [..., min(k, W)]."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    return order[..., : min(k, scores.shape[-1])]


def candidate_mask(scores: torch.Tensor, visible: torch.Tensor, *, num_blocks: int, block_size: int) -> torch.Tensor:
    """Level-1 mask [B, S, W] (bool) from level-1 scores [B, S, W] and visible counts [B, S]."""
    width = scores.shape[-1]
    blocks = F.pad(scores, (0, -width % block_size), value=-torch.inf).unflatten(-1, (-1, block_size)).amax(-1)
    newest = (visible - 1).div(block_size, rounding_mode="floor")  # −1 when nothing is visible
    block_ids = torch.arange(blocks.shape[-1], device=scores.device)
    blocks = blocks.masked_fill(block_ids == newest.unsqueeze(-1), torch.inf)  # [B, S, NB]
    chosen = top_indices(blocks, num_blocks)
    keep = torch.zeros_like(blocks, dtype=torch.bool)
    keep = keep.scatter(-1, chosen, blocks.gather(-1, chosen) > -torch.inf)
    entries = keep.repeat_interleave(block_size, dim=-1)[..., :width]
    visible_cols = torch.arange(width, device=scores.device) < visible.unsqueeze(-1)
    return entries & visible_cols


def select_entries(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Level-2 selection: indices [B, S, min(k, W)] ascending, −1 where fewer than k are finite."""
    chosen = top_indices(scores, k)
    valid = torch.isfinite(scores.gather(-1, chosen))
    chosen = torch.where(valid, chosen, scores.shape[-1])  # sort invalid picks last
    chosen = chosen.sort(dim=-1).values
    return torch.where(chosen < scores.shape[-1], chosen, -1)


def selection_mask(indices: torch.Tensor, width: int) -> torch.Tensor:
    """Indices [B, S, k] (−1 = none) → bool mask [B, S, width]."""
    mask = torch.zeros(*indices.shape[:-1], width + 1, dtype=torch.bool, device=indices.device)
    mask = mask.scatter(-1, torch.where(indices >= 0, indices, width), True)
    return mask[..., :width]
