"""The decode step with static shapes and device-only ops: what a CUDA graph captures.

A ``StaticDecodeStep`` of G rows owns persistent input buffers. ``prepare(plan)`` (host work allowed)
fills them from a decode-only StepPlan (nextn = 0: one row per request, row i = request i) and pads
rows n … G−1 with placeholder rows; ``run()`` then goes from the buffers to logits [G, vocab] and
expert counts [layers, experts] with no host sync and no data-dependent shape, so a graph replays it.

Placeholder rows sit at position 0 of state slot 0 with an all-zero block table: every write they do
lands in the null state slot 0 or the null block 0 (id 0 is never handed out by either pool: see
scheduler_rs/src/block_manager.rs), they count towards no expert, and their logits are trimmed by
the caller. A real row that closes no compressed group writes its would-be entry to pool slot 0
(block 0) too, so every row writes every layer and no write depends on a row's data.

Per layer the step reuses the model's own modules exactly as ``CachedStep.attend`` does (wq_a,
q_norm, wq_b, wkv, kv_norm, compressor, indexer, ``_project_out``; ``Block.run`` for Engram, mHC and
MoE), so a kernel backend's swapped modules drop in unchanged. Decode makes the cached step simpler:
the window ring is written first and then read whole (it holds the current row), a ratio-2 group's
other member is always in the slot's fp32 partial rows, and the indexer scores a fixed width of
``max_blocks_per_request · entries per block`` entries gathered from the pool through the block
tables, masked at each row's visible count. The three ops that want kernels each sit behind one
function (``_index_select``, ``_compress``, ``_attend``), now in static torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model.deepseek_v41.attention import Attention
from model.deepseek_v41.indexer import select_entries
from model.deepseek_v41.mhc import collapse, initial_pre
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41 import quant
from model.deepseek_v41.quant import INDEXER_BLOCK, dequantize_fp4_cache, fake_quant_indexer
from model.deepseek_v41.rope import apply_rope, rope_angles
from scheduler_rs import StepPlan
from services.worker.cache_engine import CacheEngine
from services.worker.step_batch import PendingInputs, StepBatch

ATTENTION = ("reference", "triton")  # kernels.reference.sparse_decode_attention / kernels.decode_attention


@dataclass
class _Sparse:
    """What the nearest KV / index source published this step (spec §3.4), over the G rows."""

    ratio: int = 0
    source: int | None = None  # the KV source layer whose pool holds the entries
    keys: torch.Tensor | None = None  # [G, W, di] fp32 index keys of every row's entries 0…W−1
    selected: torch.Tensor | None = None  # [G, ≤topk] int32 pool slots (−1 = none)
    candidates: torch.Tensor | None = None  # [G, W] bool


class StaticDecodeStep:
    def __init__(self, model: DeepseekV41, cache: CacheEngine, num_rows: int, max_blocks_per_request: int, *,
                 attention: str) -> None:
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.model, self.cache, self.cfg = model, cache, model.cfg
        self.attention = attention
        self.num_rows = num_rows
        self.max_blocks = max_blocks_per_request
        self.device = device = model.embed.weight.device
        cfg = self.cfg

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(num_rows)  # [G]
        self.positions = zeros(num_rows)  # [G]
        self.state_slots = zeros(num_rows)  # [G] the row's request's slot; 0 for placeholder rows
        self.ring_slots = zeros(num_rows)  # [G] position mod ring size
        self.block_tables = zeros(num_rows, max_blocks_per_request)  # [G, B] padded with the null block 0
        self.live = zeros(num_rows, dtype=torch.bool)  # [G] real rows (count towards experts)
        ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids})
        # ratio → [G] pool slot of the entry the row's group closes; 0 (the null block) for no entry.
        self.entry_slots = {r: zeros(num_rows) for r in ratios}
        self.num_live = 0  # host copy of the real rows, for trimming
        hd = cfg.head_dim
        self._no_pool = torch.zeros(1, 1, hd // 2 + hd // 16, dtype=torch.uint8, device=device)  # ratio-0 layers
        self._no_selection = torch.zeros(num_rows, 0, dtype=torch.int32, device=device)
        self._fp4 = _DeviceFp4(device)

    # ---- host side: fill the buffers -----------------------------------------------------------

    @staticmethod
    def fits(plan: StepPlan) -> bool:
        """A decode-only plan with rows: one row per request (no drafts), a graph size chosen."""
        return (not plan.is_prefill and not plan.is_placeholder and plan.graph_size is not None
                and plan.num_rows > 0 and plan.num_rows == plan.num_requests)

    def prepare(self, plan: StepPlan, pending: PendingInputs | None = None) -> None:
        """Fill the buffers from ``plan`` (host work; before a replay). Rows past the plan's are placeholders."""
        n, g = plan.num_rows, self.num_rows
        if not self.fits(plan) or n > g:
            raise ValueError(f"not a decode-only plan of ≤ {g} rows (one per request): {plan}")
        if plan.block_table_width > self.max_blocks:
            raise ValueError(f"block tables of {plan.block_table_width} > {self.max_blocks} blocks per request")
        if pending is None and any(plan.inputs_pending.tolist()):
            raise ValueError("the plan's inputs wait on a step in flight (async scheduling): pass them")
        batch = StepBatch.from_plan(plan, "cpu")
        if pending is not None:
            batch.fill_pending(plan, pending)
        ring = self.cache.layout.ring_size
        if not torch.equal(batch.ring_slots, batch.positions % ring):
            raise ValueError(f"the plan's ring slots are not position mod {ring}")

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat((x, x.new_zeros(g - n, *x.shape[1:])))

        self.input_ids.copy_(padded(batch.input_ids))
        self.positions.copy_(padded(batch.positions))
        self.state_slots.copy_(padded(batch.state_slots))
        self.ring_slots.copy_(padded(batch.ring_slots))
        tables = torch.zeros(g, self.max_blocks, dtype=torch.long)
        tables[:n, : plan.block_table_width] = batch.block_tables
        self.block_tables.copy_(tables)
        self.live.copy_(torch.arange(g) < n)
        for ratio, buf in self.entry_slots.items():
            rows, slots = batch.entry_writes.get(ratio, (torch.zeros(0, dtype=torch.long),) * 2)
            host = torch.zeros(g, dtype=torch.long)
            host[rows] = slots
            buf.copy_(host)
        self.num_live = n

    def prepare_placeholders(self) -> None:
        """Every row a placeholder (graph warm-up and capture): the step then touches only block 0 / slot 0."""
        for buf in (self.input_ids, self.positions, self.state_slots, self.ring_slots, self.block_tables,
                    *self.entry_slots.values()):
            buf.zero_()
        self.live.zero_()
        self.num_live = 0

    # ---- device side: the step ------------------------------------------------------------------

    @torch.no_grad()
    def run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffers → (logits fp32 [G, vocab], expert counts int64 [layers, experts] of the live rows)."""
        cfg, model = self.cfg, self.model
        counts = torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.long, device=self.device)
        engram_rows = self._engram_rows() if model.hasher is not None else None
        ids = self.input_ids.unsqueeze(0)  # [1, G]
        h = model.embed(ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)  # [1, G, n, D]
        pre = initial_pre(ids.shape, cfg.hc_mult, self.device)  # [1, G, n]
        self.sparse = _Sparse()
        with self._fp4.installed():
            h, pre = self._layers(h, pre, engram_rows, counts)
        y = model.norm(collapse(h, pre))[0]  # [G, D]
        return F.linear(y.float(), model.head.weight.float()), counts

    def _layers(self, h: torch.Tensor, pre: torch.Tensor, engram_rows: torch.Tensor | None, counts: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        for block in self.model.layers:
            def attend(x: torch.Tensor, attn: Attention = block.attn) -> torch.Tensor:
                return self._attend_layer(attn, x[0]).unsqueeze(0)

            ffn_input: list[torch.Tensor] = []
            hook = block.ffn.register_forward_pre_hook(lambda _module, args: ffn_input.append(args[0]))
            try:  # no counts into the MoE: it would count placeholder rows (and bincount syncs)
                h, pre = block.run(h, pre, attend, engram_rows, None, None)
            finally:
                hook.remove()
            self._count(block.ffn, ffn_input[0], counts[block.layer])
        return h, pre

    def _count(self, ffn: torch.nn.Module, x: torch.Tensor, counts: torch.Tensor) -> None:
        """counts [E] += the live rows' routed experts; placeholder rows add 0. Routes a second time
        (``forward`` does not return its choices): the model MoE's ``route``, or the kernel MoE's router
        kernel (services/worker/kernel_moe.py, which has no ``route``); a row mask on the MoE would
        retire this."""
        x = x.reshape(-1, x.shape[-1])  # [G, D]
        if hasattr(ffn, "route"):
            _, experts = ffn.route(x)  # [G, k]
        else:
            _, experts = ffn.kernels.moe_router.moe_router(x.contiguous(), ffn.gate_weight, ffn.gate_bias, ffn.top_k,
                                                           ffn.route_scale)
        experts = experts.long()
        counts.scatter_add_(0, experts.flatten(), self.live.long().unsqueeze(-1).expand(experts.shape).flatten())

    def _engram_rows(self) -> torch.Tensor:
        """Table rows [1, G, L, heads]; writes each row's compressed id to its slot's history
        (``CachedStep.engram_rows`` for one row per request: only position p itself is this step's)."""
        hasher, history = self.model.hasher, self.cache.engram_history()
        size = history.shape[1]
        comp = hasher.token_map[self.input_ids]  # [G]
        look = self.positions.unsqueeze(-1) - torch.arange(hasher.max_ngram, device=self.device)  # [G, m]: p, p−1, …
        carried = history[self.state_slots.unsqueeze(-1), look % size].long()  # read before the write below
        tokens = torch.cat((comp.unsqueeze(-1), carried[:, 1:]), dim=1)
        tokens = torch.where(look >= 0, tokens, hasher.pad)  # before the start: the pad's id
        history[self.state_slots, self.positions % size] = comp.to(torch.int32)
        return hasher.rows(tokens.unsqueeze(0))

    def _attend_layer(self, attn: Attention, x: torch.Tensor) -> torch.Tensor:
        """x [G, D] (attn_norm output) → [G, D]."""
        layer, cache = attn.layer, self.cache
        angles = rope_angles(self.positions, attn.freqs)  # [G, P]
        q_latent = attn.q_norm(attn.wq_a(x))  # [G, q_lora]
        q = apply_rope(attn.wq_b(q_latent).unflatten(-1, (attn.num_heads, attn.head_dim)), angles)  # [G, H, hd]
        k = apply_rope(attn.kv_norm(attn.wkv(x)), angles)  # [G, hd]
        cache.write_window(layer, self.state_slots, self.ring_slots, k)  # the ring now holds the row itself
        pool, selected = self._no_pool, self._no_selection
        if attn.ratio:
            self._sparse_layer(attn, x, q_latent, angles)
            pool, selected = cache.entries(self.sparse.source)[0], self.sparse.selected
        out = _attend(q, cache.ring(layer), self.state_slots, self.positions, attn.window, pool, selected,
                      attn.attn_sink, attn.freqs, attn.head_dim**-0.5, self.attention)  # [G, H, hd], RoPE undone
        return attn._project_out(out.unsqueeze(1), torch.zeros_like(angles).unsqueeze(1))[:, 0]  # angle 0: identity

    def _sparse_layer(self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor) -> None:
        ratio, cache = attn.ratio, self.cache
        if attn.compressor is not None:
            _compress(attn, x, cache, self.state_slots, self.positions, self.entry_slots[ratio])
            epb = cache.layout.source(attn.layer).entries_per_block
            keys = _read_keys(cache, attn.layer, self.block_tables, self.max_blocks * epb)
            self.sparse = _Sparse(ratio, attn.layer, keys)
        sparse = self.sparse
        if sparse.ratio != ratio or sparse.source is None:
            raise ValueError(f"layer {attn.layer} needs a preceding KV source with ratio {ratio}")
        if attn.indexer is None:
            return  # reuse the nearest index source's selection
        visible = (self.positions + 1) // ratio  # [G]
        entries, candidates = _index_select(attn, x, q_latent, angles, sparse.keys, visible, sparse.candidates)
        epb = cache.layout.source(sparse.source).entries_per_block
        sparse.selected = _entry_slots(entries, self.block_tables, epb)
        sparse.candidates = candidates


# ---- the ops that want kernels ------------------------------------------------------------------


def _index_select(attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor,
                  keys: torch.Tensor, visible: torch.Tensor, candidates: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Indexer scores over each row's W entries, candidate blocks, top-k (model/deepseek_v41/indexer.py
    semantics, lower index first among ties). x [G, D], q_latent [G, q_lora], angles [G, P], keys
    [G, W, di], visible [G] → (entry ids [G, ≤topk] ascending, −1 = none; candidates [G, W] to carry).
    Replaced by kernels/indexer.py (which should bound its loop by ``visible``, not W)."""
    query = fake_quant_indexer(attn.indexer.query(q_latent, angles))  # [G, Hi, di]
    scores = attn.indexer.scores_quantized(query.unsqueeze(1), x.unsqueeze(1), keys, visible.unsqueeze(1))
    scores, candidates = attn.restrict_to_candidates(scores, visible.unsqueeze(1), candidates)  # [G, 1, W]
    return select_entries(scores, attn.index_topk)[:, 0], candidates


def _compress(attn: Attention, x: torch.Tensor, cache: CacheEngine, state_slots: torch.Tensor,
              positions: torch.Tensor, entry_slots: torch.Tensor) -> None:
    """Every row's would-be group entry (spec §3.6) to ``entry_slots`` (pool slot 0 where the row
    closes no group), and, for ratio 2, the row's fp32 (value, gate) to its slot's partial rows; the
    group's other member comes from those rows (decode: it arrived in an earlier step). x [G, D].
    Replaced by kernels/compressor.py."""
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


def _attend(q: torch.Tensor, ring: torch.Tensor, state_slots: torch.Tensor, positions: torch.Tensor, window: int,
            kv_pool: torch.Tensor, selected: torch.Tensor, sink: torch.Tensor, freqs: torch.Tensor, scale: float,
            attention: str) -> torch.Tensor:
    """Sparse decode attention over the ring (written this step) and the selected pool slots, sink
    and undo-RoPE; the contract of ``kernels.reference.sparse_decode_attention``. ``attention``
    picks the implementation: "triton" is kernels/decode_attention.py ``sparse_decode_attention``
    (CUDA; fp32 queries keep fp32 dots, as the model computes), "reference" the torch one."""
    if attention == "triton":
        from kernels.decode_attention import sparse_decode_attention

        return sparse_decode_attention(q, ring, state_slots, positions, window, kv_pool, selected, sink.float(),
                                       freqs, scale, dot_fp32=q.dtype == torch.float32)
    from kernels.reference import sparse_decode_attention as reference

    return reference(q, ring, state_slots, positions, window, kv_pool, selected, sink, freqs, scale)


# ---- glue ---------------------------------------------------------------------------------------


class _DeviceFp4:
    """``quant.encode_e2m1`` / ``decode_e2m1`` with their tables made once on the device.

    The model's versions build the tables from Python tuples on every call: a host-to-device copy,
    which a CUDA graph capture refuses. ``installed()`` swaps these twins into the quant module for
    the duration of a step (every FP4 path there looks them up at call time); the maths is the
    same op for op, which the CPU bit-identity test checks. (A fix in quant.py would retire this.)"""

    def __init__(self, device: torch.device) -> None:
        self.midpoints = torch.tensor(quant._E2M1_MIDPOINTS, device=device)  # [7] fp32
        self.table = torch.tensor(quant._E2M1_MAGNITUDES + tuple(-m for m in quant._E2M1_MAGNITUDES),
                                  device=device)  # [16] fp32

    def encode(self, normalized: torch.Tensor) -> torch.Tensor:
        x = normalized.float().clamp(-quant.FP4_E2M1_MAX, quant.FP4_E2M1_MAX)
        magnitude = x.abs().contiguous()
        lower = torch.bucketize(magnitude, self.midpoints)
        tie = magnitude == self.midpoints[lower.clamp_max(self.midpoints.numel() - 1)]
        index = lower + (tie & (lower % 2 == 1)).to(lower.dtype)
        return (index | ((x < 0).to(index.dtype) << 3)).to(torch.uint8)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return self.table[(codes & 15).long()]

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        saved = quant.encode_e2m1, quant.decode_e2m1
        quant.encode_e2m1, quant.decode_e2m1 = self.encode, self.decode
        try:
            yield
        finally:
            quant.encode_e2m1, quant.decode_e2m1 = saved


def _read_keys(cache: CacheEngine, layer: int, block_tables: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 index keys [G, width, di] of entries 0…width−1 through each row's block table [G, B]
    (``CacheEngine.read_entries`` without the KV half, which only the attention reads)."""
    epb = cache.layout.source(layer).entries_per_block
    e = torch.arange(width, device=block_tables.device)
    raw = cache.entries(layer)[1][block_tables[:, e // epb], e % epb]  # [G, W, key bytes]
    half = cache.layout.index_head_dim // 2
    return dequantize_fp4_cache(raw[..., :half], raw[..., half:].view(torch.float8_e8m0fnu), INDEXER_BLOCK)


def _entry_slots(entries: torch.Tensor, block_tables: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """Entry ids [G, k] (−1 = none) → int32 pool slots (``kernels.reference.entry_slots``)."""
    from kernels.reference import entry_slots

    return entry_slots(entries, block_tables, entries_per_block)
