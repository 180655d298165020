"""Manifold-constrained hyper-connections (spec §3.3).

The residual state is ``hc_mult`` streams [B, S, n, D]. Each sublayer site predicts, from the
streams themselves, a pre-collapse weight, a post weight and a Sinkhorn-normalised n×n mixing
matrix. The "pre" weight a site computes is used by the *next* site (spec §3.1): the attention
site collapses with the previous FFN site's pre, the FFN site with this layer's attention pre.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.config import ModelConfig


class Mix(NamedTuple):
    pre: torch.Tensor  # fp32 [B, S, n]
    post: torch.Tensor  # fp32 [B, S, n], in (0, 2)
    comb: torch.Tensor  # fp32 [B, S, n(source), n(destination)]


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """[..., n, n] logits → doubly (approximately) stochastic matrix; rows are sources."""
    c = logits.softmax(dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


class HyperConnection(nn.Module):
    """One site's mixer: ``fn`` [n(n+2), n·D], ``base`` [n(n+2)], ``scale`` [3], all fp32."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.n = n
        self.iters = cfg.hc_sinkhorn_iters
        self.eps = cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros(n * (n + 2), n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros(n * (n + 2)))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, h: torch.Tensor) -> Mix:  # h [B, S, n, D]
        n = self.n
        flat = h.flatten(2).float()  # [B, S, n·D]
        # The projection is taken before the RMS factor; the same maths as normalising first.
        m = F.linear(flat, self.fn.float()) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)
        scales = torch.cat((self.scale[0].expand(n), self.scale[1].expand(n), self.scale[2].expand(n * n)))
        logits = torch.addcmul(self.base, m, scales)  # [B, S, n(n+2)]
        pre = torch.sigmoid(logits[..., :n]) + self.eps
        post = 2 * torch.sigmoid(logits[..., n : 2 * n])
        comb = sinkhorn(logits[..., 2 * n :].unflatten(-1, (n, n)), self.iters, self.eps)
        return Mix(pre, post, comb)

    # A site's whole use of the streams goes through the module (Block.run), so a backend that swaps the
    # module (services/worker/kernel_model/backend.py) swaps the collapse and expand with it.

    def mix_collapse(self, h: torch.Tensor, pre: torch.Tensor) -> tuple[Mix, torch.Tensor]:
        """(this site's Mix of h, Collapse(h, pre)) with the previous site's ``pre``: h [B, S, n, D]."""
        return self(h), collapse(h, pre)

    def expand(self, y: torch.Tensor, h: torch.Tensor, mix: Mix) -> torch.Tensor:
        """Expand(y, h, mix) with this site's ``mix``."""
        return expand(y, h, mix)

    def expand_mix_collapse(
        self, y: torch.Tensor, h: torch.Tensor, previous: Mix
    ) -> tuple[torch.Tensor, Mix, torch.Tensor]:
        """The previous site's Expand(y, h, previous), then this site's ``mix_collapse`` of the new
        streams with the previous site's pre: (h', Mix(h'), Collapse(h', previous.pre))."""
        h = expand(y, h, previous)
        return (h, *self.mix_collapse(h, previous.pre))


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """Σ_s pre_s · h_s: h [B, S, n, D], pre [B, S, n] → [B, S, D]."""
    return (pre.unsqueeze(-1) * h.float()).sum(2).to(h.dtype)


def expand(y: torch.Tensor, h: torch.Tensor, mix: Mix) -> torch.Tensor:
    """New stream k = post_k · y + Σ_j comb[j, k] · h_j: y [B, S, D], h [B, S, n, D] → [B, S, n, D]."""
    update = mix.post.unsqueeze(-1) * y.unsqueeze(-2)
    mixed = (mix.comb.unsqueeze(-1) * h.unsqueeze(-2)).sum(2)
    return (update + mixed).to(y.dtype)


def initial_pre(batch_shape: torch.Size, n: int, device: torch.device | None = None) -> torch.Tensor:
    """The carried collapse weight before layer 0: one-hot on stream 0, fp32 [B, S, n]."""
    pre = torch.zeros(*batch_shape, n, device=device)
    pre[..., 0] = 1
    return pre
