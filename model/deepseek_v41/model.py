"""DeepSeek-V4.1 text backbone, full-sequence reference forward (spec §3.1).

    e = embed[ids]; h = n copies of e [B, S, n, D]; pre = one-hot(stream 0)
    for layer ℓ:
        h ← Engram(h)                          (Engram layers only)
        mixA = Mix(h; hc_attn);  a = Attn(attn_norm(Collapse(h, pre)));  h ← Expand(a, h, mixA)
        mixF = Mix(h; hc_ffn);   f = MoE(ffn_norm(Collapse(h, mixA.pre))); h ← Expand(f, h, mixF)
        pre ← mixF.pre
    logits = head(norm(Collapse(h, pre)))      (the final collapse is learned, not a mean)

Image placeholders (spec §3.13): with a vision tower, every position holding ``image_token_id`` takes
its embedding from the image encoder's spans instead of ``embed``; Engram treats it as dead and the
router selects its experts with ``bias_vl``.

Positions are 0..S−1 for every row (reference mode). ``Block.run`` is the layer around its
attention, so the cached engine (``services/worker/model_runner.py``) reuses everything but the
attention, which it replaces with one that reads and writes the paged caches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.attention import Attention, SparseState
from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.engram import Engram, EngramHasher
from model.deepseek_v41.mhc import HyperConnection, collapse, initial_pre
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.norm import RMSNorm
from model.deepseek_v41.vision import ImageEncoder


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

    def forward(self, h: torch.Tensor, pre: torch.Tensor, positions: torch.Tensor, state: SparseState,
                engram_rows: torch.Tensor | None, live: torch.Tensor | None, image: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, SparseState]:
        """h [B, S, n, D], pre fp32 [B, S, n] → (h, next pre, state); ``image`` [B, S] bool marks image-span tokens."""
        published = [state]

        def attend(x: torch.Tensor) -> torch.Tensor:
            out, published[0] = self.attn(x, positions, published[0])
            return out

        h, pre = self.run(h, pre, attend, engram_rows, live, image=image)
        return h, pre, published[0]

    def run(self, h: torch.Tensor, pre: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor],
            engram_rows: torch.Tensor | None, live: torch.Tensor | None,
            expert_counts: torch.Tensor | None = None, image: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer around its attention: ``attend`` maps attn_norm output [B, S, D] → [B, S, D]
        (the full-sequence attention, or a cached engine's). ``engram_rows`` [B, S, L, heads] for
        every Engram layer; ``expert_counts`` int64 [E] gains this layer's routed tokens; ``image``
        [B, S] bool (None: none) routes those tokens with ``bias_vl``. Dead tokens are not ``live``."""
        if self.engram is not None:
            h = self.engram(h, engram_rows[:, :, self.engram_index], live)
        mix_a, x = self.hc_attn.mix_collapse(h, pre)
        h, mix_f, x = self.hc_ffn.expand_mix_collapse(attend(self.attn_norm(x)), h, mix_a)
        # ``image`` only when some token is one: other ffn backends (KernelMoE) take (x, counts).
        f = self.ffn(self.ffn_norm(x), expert_counts) if image is None else \
            self.ffn(self.ffn_norm(x), expert_counts, image=image)
        h = self.hc_ffn.expand(f, h, mix_f)
        return h, mix_f.pre


class DeepseekV41(nn.Module):
    """The model. ``token_map``/``num_compressed`` (from the tokenizer) are needed iff Engram layers exist;
    ``encoder`` (images → span embeddings) exists iff ``cfg.vision`` does."""

    def __init__(self, cfg: ModelConfig, token_map: Sequence[int] | torch.Tensor | None = None,
                 num_compressed: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hasher = None
        if cfg.engram_layer_ids:
            if token_map is None or num_compressed is None:
                raise ValueError("a config with Engram layers needs the tokenizer's Engram token map")
            self.hasher = EngramHasher(cfg, token_map, num_compressed)
        self.encoder = ImageEncoder(cfg.vision, cfg.hidden_size) if cfg.vision is not None else None

    def embed_inputs(self, ids: torch.Tensor, image_rows: torch.Tensor | None = None,
                     image: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids int [B, S] → (embeddings [B, S, D], image mask [B, S] bool or None when no position is an
        image position). ``image_rows`` [P, D]: the span embeddings of the P image positions, in row-major
        (b, s) order; exactly as many as there are. The image positions are ``image`` [B, S] bool when given
        (a cached engine's prompt positions), else every position holding the placeholder id."""
        e = self.embed(ids)  # [B, S, D]
        if image is None:
            image = None if self.cfg.vision is None else ids == self.cfg.vision.image_token_id
        num_placeholders = 0 if image is None else int(image.sum())
        num_rows = 0 if image_rows is None else image_rows.shape[0]
        if num_rows != num_placeholders:
            raise ValueError(f"{num_placeholders} image placeholder positions but {num_rows} image embedding rows")
        if num_placeholders == 0:
            return e, None
        return e.masked_scatter(image.unsqueeze(-1), image_rows.to(e.dtype)), image

    def forward(self, ids: torch.Tensor, live: torch.Tensor | None = None,
                image_rows: torch.Tensor | None = None) -> torch.Tensor:
        """ids int [B, S] → logits fp32 [B, S, vocab]. ``live`` [B, S] bool marks tokens Engram may read;
        ``image_rows`` [P, D] fill the image placeholders (``embed_inputs``), which are never live."""
        b, s = ids.shape
        if s == 0:
            raise ValueError("empty sequence")
        positions = torch.arange(s, device=ids.device).expand(b, s)
        e, image = self.embed_inputs(ids, image_rows)  # [B, S, D], [B, S] or None
        if image is not None:
            live = ~image if live is None else live & ~image
        h = e.unsqueeze(2).expand(-1, -1, self.cfg.hc_mult, -1)  # [B, S, n, D]
        pre = initial_pre(ids.shape, self.cfg.hc_mult, ids.device)
        rows = self.hasher.rows(self.hasher.history(ids, live)) if self.hasher is not None else None
        state = SparseState()
        for block in self.layers:
            h, pre, state = block(h, pre, positions, state, rows, live, image)
        y = self.norm(collapse(h, pre))  # [B, S, D]
        return F.linear(y.float(), self.head.weight.float())
