"""The torch reference backend of ``AttentionStep``: any step's rows, the model's own functions, reading
and writing the pools by the plan's slots. The CPU path, and the engine's side of the oracle tests.

Every row is its own query (shape [R, ...], then [R, 1, ...] where a model function wants [B, S, ...]).
Its keys are gathered per row, ordered window then selected entries:

- window: positions p−w+1 … p; those before the request's first row this step come from the state
  slot's FP8 ring (read before this step writes it), the others from this step's rows;
- compressed entries: the KV source writes this step's complete groups into its blocks first, then
  every request's visible entries are read back (dequantised FP4 = the model's fake quantisation), so
  a row sees entries its own step just made;
- a ratio-2 group whose first token came in an earlier step takes that token's fp32 (value, gate)
  from the slot's partial-group rows.

Reads of a state slot happen before the step's writes to it; writes keep only each request's last
``size`` positions, so a position-mod-size index never collides within one step.

In the batch-invariant mode (docs/batch-invariance.md) every row's keys are the fixed layout
``window + index_topk`` (selection padded with −1), as the model's ``Attention._attend_per_query``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import batch_invariant
from model.deepseek_v41.attention import Attention, sink_attention
from model.deepseek_v41.indexer import select_entries
from model.deepseek_v41.quant import fake_quant_fp8_e4m3, fake_quant_indexer
from model.deepseek_v41.rope import apply_rope, rope_angles
from services.worker.attention.backend import StepRounding
from services.worker.batch.step_batch import StepBatch
from services.worker.state.cache_engine import CacheEngine


@dataclass
class StepSparse:
    """What the nearest KV / index source published this step (spec §3.4)."""

    ratio: int = 0
    kv: torch.Tensor | None = None  # [N, W, hd] each request's entries 0..W−1 (dequantised)
    keys: torch.Tensor | None = None  # [N, W, di]
    selected: torch.Tensor | None = None  # [R, 1, ≤topk] ascending entry ids, −1 = none
    candidates: torch.Tensor | None = None  # [R, 1, W] bool


class TorchAttention:
    undoes_rope = False  # the step's project_out undoes it, as the model's forward does

    def __init__(self, cache: CacheEngine, batch: StepBatch, rounding: StepRounding | None = None) -> None:
        self.cache = cache
        self.b = batch
        self.rounding = rounding or StepRounding()
        self.sparse = StepSparse()
        self.row_slots = batch.state_slots[batch.row_requests]  # [R]

    # ---- compressed entries and sparse selection ----------------------------------------------

    def compress(self, attn: Attention, x: torch.Tensor) -> None:
        """Write this step's complete groups (spec §3.6) to the source's blocks, carry the fp32 rows of
        incomplete groups in the state slot, then read every request's entries back."""
        self.write_groups(attn, x)
        kv, keys = self.cache.read_entries(attn.layer, self.b.block_tables, self.b.max_entries(attn.ratio))
        self.sparse = StepSparse(attn.ratio, kv.to(x.dtype), keys.to(x.dtype))

    def select(self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor) -> None:
        b, sparse, ratio = self.b, self.sparse, attn.ratio
        if sparse.ratio != ratio or sparse.kv is None:
            raise ValueError(f"layer {attn.layer} needs a preceding KV source with ratio {ratio}")
        if attn.indexer is None:
            return  # reuse the nearest index source's selection
        visible = ((b.positions + 1) // ratio).unsqueeze(-1)  # [R, 1]
        query = self.rounding("idx4q", attn.layer, attn.indexer.query(q_latent, angles), b.row_requests, b.positions)
        scores = attn.indexer.scores_quantized(
            fake_quant_indexer(query).unsqueeze(1), x.unsqueeze(1), sparse.keys[b.row_requests], visible
        )  # [R, 1, W]
        scores, candidates = attn.restrict_to_candidates(scores, visible, sparse.candidates)
        self.sparse = StepSparse(ratio, sparse.kv, sparse.keys, select_entries(scores, attn.index_topk), candidates)

    def write_groups(self, attn: Attention, x: torch.Tensor) -> None:
        """The pool and partial-row writes of ``compress``, without the read-back (x [R, D])."""
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
        kv = self.rounding("kv4", attn.layer, apply_rope(latent, angles), requests, entry)
        idx = attn.indexer
        keys = self.rounding("idx4k", attn.layer, apply_rope(idx.k_norm(idx.wk(latent)), angles), requests, entry)
        self.cache.write_entries(attn.layer, slots, kv, keys)

    # ---- attention ----------------------------------------------------------------------------

    def attend(self, attn: Attention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        b = self.b
        keys, allowed = self._window(attn.layer, attn.window, k)  # [R, w, hd], [R, w]
        if attn.ratio:
            sel = self.sparse.selected[:, 0]  # [R, k]
            if batch_invariant.active() and sel.shape[1] < attn.index_topk:
                # The key count must not follow the batch's longest request (model/batch_invariant.py).
                sel = F.pad(sel, (0, attn.index_topk - sel.shape[1]), value=-1)
            width = self.sparse.kv.shape[1]
            flat = self.sparse.kv.flatten(0, 1)  # [N·W, hd]
            picked = (
                flat[(b.row_requests.unsqueeze(-1) * width + sel).clamp_min(0)]
                if flat.numel()
                else flat.new_zeros(*sel.shape, attn.head_dim)
            )
            keys = torch.cat((keys, picked.to(keys.dtype)), dim=1)
            allowed = torch.cat((allowed, sel >= 0), dim=1)
        out = sink_attention(q.unsqueeze(1), keys, allowed.unsqueeze(1), attn.attn_sink, attn.head_dim**-0.5)
        return out[:, 0]  # [R, H, hd], RoPE not undone

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
