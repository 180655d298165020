"""One step of the cached forward: attention, compressors, indexers and Engram history over the
rows of every request at once, reading and writing the pools by the plan's slots.

Every row is its own query (shape [R, ...], then [R, 1, ...] where a model function wants
[B, S, ...]). Its keys are gathered per row, ordered window then selected entries:

- window: positions p−w+1 … p; those before the request's first row this step come from the
  state slot's FP8 ring (read before this step writes it), the others from this step's rows;
- compressed entries: the KV source writes this step's complete groups into its blocks first, then
  every request's visible entries are read back (dequantised FP4 = the model's fake quantisation),
  so a row sees entries its own step just made;
- a ratio-2 group whose first token came in an earlier step takes that token's fp32 (value, gate)
  from the slot's partial-group rows; Engram looks back into the slot's compressed-id history.

Reads of a state slot happen before the step's writes to it; writes keep only each request's last
``size`` positions, so a position-mod-size index never collides within one step.

``rounding`` (tests, tracing) sees every pre-rounding tensor with its request ids and positions (or
entry numbers) and may return it changed: the oracle harness replays the reference's decision at
values within FLIP_BOUNDARY_TOL of a bin edge.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import batch_invariant
from model.deepseek_v41.attention import Attention, sink_attention
from model.deepseek_v41.engram import EngramHasher
from model.deepseek_v41.indexer import select_entries
from model.deepseek_v41.quant import fake_quant_fp8_e4m3, fake_quant_indexer
from model.deepseek_v41.rope import apply_rope, rope_angles
from services.worker.cache_engine import CacheEngine
from services.worker.step_batch import StepBatch

# (kind, layer, pre-rounding values [n, ...], request id per value row, position or entry per row) → values.
# Kinds: "fp8" window K, "kv4" compressed entries, "idx4k" index keys, "idx4q" index queries.
Rounding = Callable[[str, int, torch.Tensor, list[str], torch.Tensor], torch.Tensor]


@dataclass
class StepSparse:
    """What the nearest KV / index source published this step (spec §3.4)."""

    ratio: int = 0
    kv: torch.Tensor | None = None  # [N, W, hd] each request's entries 0..W−1 (dequantised)
    keys: torch.Tensor | None = None  # [N, W, di]
    selected: torch.Tensor | None = None  # [R, 1, ≤topk] ascending entry ids, −1 = none
    candidates: torch.Tensor | None = None  # [R, 1, W] bool


class CachedStep:
    def __init__(self, cache: CacheEngine, batch: StepBatch, rounding: Rounding | None = None) -> None:
        self.cache = cache
        self.b = batch
        self.rounding = rounding
        self.sparse = StepSparse()
        self.row_slots = batch.state_slots[batch.row_requests]  # [R]

    def _round(self, kind: str, layer: int, x: torch.Tensor, requests: torch.Tensor, index: torch.Tensor):
        if self.rounding is None:
            return x
        return self.rounding(kind, layer, x, [self.b.request_ids[i] for i in requests.tolist()], index)

    # ---- Engram -------------------------------------------------------------------------------

    def engram_rows(self, hasher: EngramHasher) -> torch.Tensor:
        """Table rows [1, R, L, heads] of every row; writes the rows' compressed ids to the history."""
        b, history = self.b, self.cache.engram_history()
        size = history.shape[1]
        comp = hasher.token_map[b.input_ids]  # [R]
        carried = history[b.state_slots].long()  # [N, size], read before this step's writes
        look = b.positions.unsqueeze(-1) - torch.arange(hasher.max_ngram, device=b.device)  # [R, m]: p, p−1, …
        in_step = look >= b.row_first().unsqueeze(-1)
        tokens = torch.where(in_step, comp[b.row_index(b.row_requests, look)],
                             carried[b.row_requests.unsqueeze(-1), look % size])
        tokens = torch.where(look >= 0, tokens, hasher.pad)  # before the start: the pad's id
        tail = b.tail(size)
        history[self.row_slots[tail], b.positions[tail] % size] = comp[tail].to(torch.int32)
        return hasher.rows(tokens.unsqueeze(0))

    # ---- attention ----------------------------------------------------------------------------

    def attend(self, attn: Attention, x: torch.Tensor) -> torch.Tensor:
        """x [R, D] (attn_norm output) → [R, D]."""
        b, layer = self.b, attn.layer
        all_rows = b.row_requests
        angles = rope_angles(b.positions, attn.freqs)  # [R, P]
        q_latent = attn.q_norm(attn.wq_a(x))  # [R, q_lora]
        q = apply_rope(attn.wq_b(q_latent).unflatten(-1, (attn.num_heads, attn.head_dim)), angles)  # [R, H, hd]
        k = self._round("fp8", layer, apply_rope(attn.kv_norm(attn.wkv(x)), angles), all_rows, b.positions)
        keys, allowed = self._window(layer, attn.window, k)  # [R, w, hd], [R, w]
        if attn.ratio:
            self.sparse = self._sparse(attn, x, q_latent, angles)
            sel = self.sparse.selected[:, 0]  # [R, k]
            if batch_invariant.active() and sel.shape[1] < attn.index_topk:
                # The key count must not follow the batch's longest request (model/batch_invariant.py).
                sel = F.pad(sel, (0, attn.index_topk - sel.shape[1]), value=-1)
            width = self.sparse.kv.shape[1]
            flat = self.sparse.kv.flatten(0, 1)  # [N·W, hd]
            picked = flat[(b.row_requests.unsqueeze(-1) * width + sel).clamp_min(0)] if flat.numel() else \
                flat.new_zeros(*sel.shape, attn.head_dim)
            keys = torch.cat((keys, picked.to(keys.dtype)), dim=1)
            allowed = torch.cat((allowed, sel >= 0), dim=1)
        out = sink_attention(q.unsqueeze(1), keys, allowed.unsqueeze(1), attn.attn_sink, attn.head_dim**-0.5)
        return attn._project_out(out, angles.unsqueeze(1))[:, 0]  # [R, D]

    def _window(self, layer: int, window: int, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, ring_size = self.b, self.cache.layout.ring_size
        ring = self.cache.read_window(layer, b.state_slots).to(k.dtype)  # [N, ring, hd], before the writes
        tail = b.tail(ring_size)
        self.cache.write_window(layer, self.row_slots[tail], b.ring_slots[tail], k[tail])
        pos = b.positions.unsqueeze(-1) - window + 1 + torch.arange(window, device=b.device)  # [R, w] ascending
        in_step = pos >= b.row_first().unsqueeze(-1)
        from_ring = b.row_requests.unsqueeze(-1) * ring_size + pos % ring_size
        from_step = b.num_requests * ring_size + b.row_index(b.row_requests, pos)
        source = torch.cat((ring.flatten(0, 1), fake_quant_fp8_e4m3(k)))  # [N·ring + R, hd]
        index = torch.where(pos >= 0, torch.where(in_step, from_step, from_ring), 0)
        return source[index], pos >= 0

    # ---- compressed entries and sparse selection ----------------------------------------------

    def _sparse(self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor) -> StepSparse:
        b, sparse, ratio = self.b, self.sparse, attn.ratio
        if attn.compressor is not None:
            self._compress(attn, x)
            width = b.max_entries(ratio)
            kv, keys = self.cache.read_entries(attn.layer, b.block_tables, width)
            sparse = StepSparse(ratio, kv.to(x.dtype), keys.to(x.dtype))
        if sparse.ratio != ratio or sparse.kv is None:
            raise ValueError(f"layer {attn.layer} needs a preceding KV source with ratio {ratio}")
        if attn.indexer is None:
            return sparse  # reuse the nearest index source's selection
        visible = ((b.positions + 1) // ratio).unsqueeze(-1)  # [R, 1]
        query = self._round("idx4q", attn.layer, attn.indexer.query(q_latent, angles), b.row_requests, b.positions)
        scores = attn.indexer.scores_quantized(fake_quant_indexer(query).unsqueeze(1), x.unsqueeze(1),
                                               sparse.keys[b.row_requests], visible)  # [R, 1, W]
        scores, candidates = attn.restrict_to_candidates(scores, visible, sparse.candidates)
        return StepSparse(ratio, sparse.kv, sparse.keys, select_entries(scores, attn.index_topk), candidates)

    def _compress(self, attn: Attention, x: torch.Tensor) -> None:
        """Write this step's complete groups (spec §3.6) to the source's blocks, and carry the
        fp32 rows of incomplete groups in the state slot."""
        b, comp, ratio = self.b, attn.compressor, attn.ratio
        rows, slots = b.entry_writes[ratio]  # rows whose position closes a group
        requests = b.row_requests[rows]
        if ratio == 1:
            latent = comp.norm(F.linear(x[rows], comp.wkv.weight.to(x.dtype)))
        else:
            values, gates = comp.project(x)  # [R, hd] fp32
            carried = self.cache.partial(attn.layer)[b.state_slots]  # [N, size, 2, hd], before the writes
            size = carried.shape[1]
            members = b.positions[rows].unsqueeze(-1) - ratio + 1 + torch.arange(ratio, device=b.device)  # [E, r]
            in_step = (members >= b.first[requests].unsqueeze(-1)).unsqueeze(-1)
            at = b.row_index(requests, members)
            old = carried[requests.unsqueeze(-1), members % size]  # [E, r, 2, hd]
            group_values = torch.where(in_step, values[at], old[:, :, 0])
            group_gates = torch.where(in_step, gates[at], old[:, :, 1])
            latent = comp.pool(group_values, group_gates, x.dtype)  # [E, hd]
            tail = b.tail(size)
            self.cache.write_partial(attn.layer, self.row_slots[tail], b.positions[tail], values[tail], gates[tail])
        starts = b.positions[rows] - ratio + 1
        entry = b.positions[rows] // ratio
        angles = rope_angles(starts, attn.freqs)
        kv = self._round("kv4", attn.layer, apply_rope(latent, angles), requests, entry)
        idx = attn.indexer
        keys = self._round("idx4k", attn.layer, apply_rope(idx.k_norm(idx.wk(latent)), angles), requests, entry)
        self.cache.write_entries(attn.layer, slots, kv, keys)
