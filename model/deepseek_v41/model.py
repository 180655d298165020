"""DeepSeek-V4.1 text backbone, full-sequence reference forward (spec §3.1).

    e = embed[ids]; h = n copies of e [B, S, n, D]; pre = one-hot(stream 0)
    for layer ℓ:
        h ← Engram(h)                          (Engram layers only)
        mixA = Mix(h; hc_attn);  a = Attn(attn_norm(Collapse(h, pre)));  h ← Expand(a, h, mixA)
        mixF = Mix(h; hc_ffn);   f = MoE(ffn_norm(Collapse(h, mixA.pre))); h ← Expand(f, h, mixF)
        pre ← mixF.pre
    logits = head(norm(Collapse(h, pre)))      (the final collapse is learned, not a mean)
    taps = concat over dspark_target_layer_ids of mean_streams(h entering that layer's attention mixer)

Image placeholders (spec §3.13): with a vision tower, every position holding ``image_token_id`` takes
its embedding from the image encoder's spans instead of ``embed``; Engram treats it as dead and the
router selects its experts with ``bias_vl``.

Positions are 0..S−1 for every row (reference mode). The DSpark draft (``draft``, model/deepseek_v41/
dspark.py) reads ``taps``, and shares ``embed`` and ``head``. ``Block.run`` is the layer around its
attention, so the cached engine (``services/worker/runners/model_runner.py``) reuses everything but the
attention, which it replaces with one that reads and writes the paged caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.attention import SparseState
from model.deepseek_v41.block import Block
from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.dspark import DSpark
from model.deepseek_v41.engram import EngramHasher
from model.deepseek_v41.mhc import collapse, initial_pre
from model.deepseek_v41.norm import RMSNorm
from model.deepseek_v41.vision import ImageEncoder

__all__ = ["Block", "DeepseekV41"]


class DeepseekV41(nn.Module):
    """The model. ``token_map``/``num_compressed`` (from the tokenizer) are needed iff Engram layers exist;
    ``encoder`` (images → span embeddings) exists iff ``cfg.vision`` does."""

    def __init__(
        self, cfg: ModelConfig, token_map: Sequence[int] | torch.Tensor | None = None, num_compressed: int | None = None
    ) -> None:
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
        self.draft = DSpark(cfg) if cfg.num_nextn_predict_layers else None
        self.encoder = ImageEncoder(cfg.vision, cfg.hidden_size) if cfg.vision is not None else None

    def embed_inputs(
        self, ids: torch.Tensor, image_rows: torch.Tensor | None = None, image: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
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

    def forward(
        self, ids: torch.Tensor, live: torch.Tensor | None = None, image_rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """ids int [B, S] → logits fp32 [B, S, vocab]. ``live`` [B, S] bool marks tokens Engram may read;
        ``image_rows`` [P, D] fill the image placeholders (``embed_inputs``), which are never live."""
        return self.forward_with_taps(ids, live, image_rows, with_taps=False)[0]

    def forward_with_taps(
        self,
        ids: torch.Tensor,
        live: torch.Tensor | None = None,
        image_rows: torch.Tensor | None = None,
        *,
        with_taps: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ids int [B, S] → (logits fp32 [B, S, vocab], the draft's target features fp32 [B, S, T·D] for
        the T = len(dspark_target_layer_ids) tapped layers, or None without ``with_taps``); ``live`` and
        ``image_rows`` as in ``forward``."""
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
        taps: list[torch.Tensor] = []
        tapped = set(self.cfg.dspark_target_layer_ids) if with_taps else set()
        for block in self.layers:
            h, pre, state = block(h, pre, positions, state, rows, live, image, taps if block.layer in tapped else None)
        y = self.norm(collapse(h, pre))  # [B, S, D]
        return F.linear(y.float(), self.head.weight.float()), torch.cat(taps, dim=-1) if taps else None
