"""The static decode step's torch ops (its "reference" path; "triton" runs the kernels) and glue:
indexer selection, the compressor's entries, sparse attention, index-key reads and entry slots, each
over the step's G static rows. ``services/worker/decode_step.py`` calls them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.deepseek_v41.attention import Attention
from model.deepseek_v41.indexer import select_entries
from model.deepseek_v41.quant import INDEXER_BLOCK, dequantize_fp4_cache, fake_quant_indexer
from model.deepseek_v41.rope import apply_rope, rope_angles
from services.worker.cache_engine import CacheEngine


# ---- the ops that want kernels ------------------------------------------------------------------


def index_select(attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor,
                  keys: torch.Tensor, visible: torch.Tensor, candidates: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Indexer scores over each row's W entries, candidate blocks, top-k (model/deepseek_v41/indexer.py
    semantics, lower index first among ties). x [G, D], q_latent [G, q_lora], angles [G, P], keys
    [G, W, di], visible [G] → (entry ids [G, ≤topk] ascending, −1 = none; candidates [G, W] to carry).
    The "reference" path's; "triton" runs ``StaticDecodeStep._index_kernel``."""
    query = fake_quant_indexer(attn.indexer.query(q_latent, angles))  # [G, Hi, di]
    scores = attn.indexer.scores_quantized(query.unsqueeze(1), x.unsqueeze(1), keys, visible.unsqueeze(1))
    scores, candidates = attn.restrict_to_candidates(scores, visible.unsqueeze(1), candidates)  # [G, 1, W]
    return select_entries(scores, attn.index_topk)[:, 0], candidates


def compress(attn: Attention, x: torch.Tensor, cache: CacheEngine, state_slots: torch.Tensor,
              positions: torch.Tensor, entry_slots: torch.Tensor) -> None:
    """Every row's would-be group entry (spec §3.6) to ``entry_slots`` (pool slot 0 where the row
    closes no group), and, for ratio 2, the row's fp32 (value, gate) to its slot's partial rows; the
    group's other member comes from those rows (decode: it arrived in an earlier step). x [G, D].
    The "reference" path's; "triton" runs kernels/compressor.py."""
    comp, ratio, layer = attn.compressor, attn.ratio, attn.layer
    if ratio == 1:
        latent = comp.norm(F.linear(x, comp.wkv.weight.to(x.dtype)))  # [G, hd]
    else:
        values, gates = comp.project(x)  # [G, hd] fp32
        partial = cache.partial(layer)
        earlier = partial[state_slots, (positions - 1) % partial.shape[1]]  # [G, 2, hd], read before the write
        latent = comp.pool(torch.stack((earlier[:, 0], values), 1), torch.stack((earlier[:, 1], gates), 1), x.dtype)
        cache.write_partial(layer, state_slots, positions, values, gates)
    angles = rope_angles(positions - ratio + 1, attn.freqs)  # at the group's first token
    idx = attn.indexer
    kv = apply_rope(latent, angles)
    keys = apply_rope(idx.k_norm(idx.wk(latent)), angles)
    cache.write_entries(layer, entry_slots, kv, keys)


def attend(q: torch.Tensor, ring: torch.Tensor, state_slots: torch.Tensor, positions: torch.Tensor, window: int,
            kv_pool: torch.Tensor, selected: torch.Tensor, sink: torch.Tensor, freqs: torch.Tensor, scale: float
            ) -> torch.Tensor:
    """Sparse decode attention over the ring (written this step) and the selected pool slots, sink
    and undo-RoPE: ``kernels.reference.sparse_decode_attention`` (the "triton" path calls
    kernels/decode_attention.py's, same contract)."""
    from kernels.reference import sparse_decode_attention as reference

    return reference(q, ring, state_slots, positions, window, kv_pool, selected, sink, freqs, scale)


# ---- glue ---------------------------------------------------------------------------------------


def read_keys(cache: CacheEngine, layer: int, block_tables: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 index keys [G, width, di] of entries 0…width−1 through each row's block table [G, B]
    (``CacheEngine.read_entries`` without the KV half, which only the attention reads)."""
    epb = cache.layout.source(layer).entries_per_block
    e = torch.arange(width, device=block_tables.device)
    raw = cache.entries(layer)[1][block_tables[:, e // epb], e % epb]  # [G, W, key bytes]
    half = cache.layout.index_head_dim // 2
    return dequantize_fp4_cache(raw[..., :half], raw[..., half:].view(torch.float8_e8m0fnu), INDEXER_BLOCK)


def entry_slots_of(entries: torch.Tensor, block_tables: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """Entry ids [G, k] (−1 = none) → int32 pool slots (``kernels.reference.entry_slots``)."""
    from kernels.reference import entry_slots

    return entry_slots(entries, block_tables, entries_per_block)
