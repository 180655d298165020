"""The graph-safe decode backend of ``AttentionStep``: G static rows (a ``StaticBatch``: one row per
request, or 1 + the drafts verified), device-only ops and no data-dependent shape, so a CUDA graph
captures it.

Decode makes the flow simpler than ``TorchAttention``'s: every row's K is written to the window ring
first and then each row reads its own window from it (the ring holds ≥ window + 1 + nextn positions,
so a request's later rows never overwrite what its earlier rows read, and an earlier row never sees a
later one: it reads positions ≤ its own); a ratio-2 group's other member is the previous row of the
same request when that position is in this step, else the slot's fp32 partial row; and the indexer
scores a fixed width of ``max_blocks · entries per block`` entries gathered from the pool through the
block tables, masked at each row's visible count (so an entry a later row of the request closes this
step is invisible to the earlier rows).

Two forms of the three ops: with ``kernels`` (the "triton" path) kernels/compressor.py
``compress_layer``, kernels/indexer.py ``indexer_select`` (FP4 keys read straight from the pool, the
query rounded by kernels/indexer_quant.py) and kernels/decode_attention.py (the window K written by
kernels/window_write.py) (CUDA, or interpreted copies for CPU tests); without (the "reference"
path) the static torch ops below (``static_compress``, ``static_index_select``, ``static_attend``:
CPU tests, bit-identity with ``TorchAttention``).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F

from kernels import reference
from model.deepseek_v41.attention import Attention, sink_attention
from model.deepseek_v41.indexer import select_entries
from model.deepseek_v41.quant import INDEXER_BLOCK, dequantize_fp4_cache, fake_quant_indexer
from model.deepseek_v41.rope import apply_rope, rope_angles
from services.worker.attention.triton_backend import index_query, index_weights
from services.worker.batch.static_batch import StaticBatch
from services.worker.state.cache_engine import CacheEngine

ATTENTION = ("reference", "triton")  # the static torch ops / the kernels


@dataclass
class StaticSparse:
    """What the nearest KV / index source published this step (spec §3.4), over the G rows."""

    ratio: int = 0
    source: int | None = None  # the KV source layer whose pool holds the entries
    keys: torch.Tensor | None = None  # reference: [G, W, di] fp32 index keys of every row's entries 0…W−1
    selected: torch.Tensor | None = None  # [G, ≤topk] int32 pool slots (−1 = none)
    candidates: torch.Tensor | None = None  # reference: bool [G, W] entries; triton: uint8 [G, ⌈W/CB⌉] blocks


def step_kernels(kernels: object | None) -> SimpleNamespace:
    """The "triton" path's modules (decode_attention, compressor, indexer) from ``kernels`` (a KernelSet:
    the runner's, or interpreted copies for CPU tests) where it has them, else the compiled ones."""
    interpreted = bool(getattr(kernels, "interpreted", False))

    def module(name: str) -> ModuleType:
        found = getattr(kernels, name, None)
        if found is None and interpreted:
            raise ValueError(f"the interpreted kernel set has no {name}: load it too (kernels/interpret.py)")
        return found if found is not None else importlib.import_module(f"kernels.{name}")

    return SimpleNamespace(
        decode_attention=module("decode_attention"),
        compressor=module("compressor"),
        indexer=module("indexer"),
        window_write=module("window_write"),
        indexer_quant=module("indexer_quant"),
        entry_slots=module("entry_slots"),
        interpreted=interpreted,
    )


class GraphAttention:
    undoes_rope = True  # both forms undo it (the decode attention kernel's contract)

    def __init__(
        self, cache: CacheEngine, rows: StaticBatch, kernels: SimpleNamespace | None, fp32_dots: bool | None
    ) -> None:
        """``kernels``: ``step_kernels``' modules for the "triton" path, None for "reference".
        ``fp32_dots``: the attention kernel's dot precision, as the eager ``TritonAttention`` picks it
        (precision "fp32" or interpreted kernels); None = fp32 for fp32 queries."""
        self.cache, self.rows, self.kernels, self.fp32_dots = cache, rows, kernels, fp32_dots
        self.sparse = StaticSparse()
        hd = cache.layout.head_dim
        self._no_pool = torch.zeros(1, 1, hd // 2 + hd // 16, dtype=torch.uint8, device=rows.device)  # ratio 0
        self._no_selection = torch.zeros(rows.num_rows, 0, dtype=torch.int32, device=rows.device)
        self._all_rows = torch.arange(rows.num_rows, device=rows.device)  # every row writes its would-be entry
        # The compressor kernel's clamped row buffers (see ``compress``): the same for every KV source layer,
        # so the first one of a run computes them. None until then.
        self._compress_rows: dict[str, torch.Tensor] | None = None

    def reset(self) -> None:
        """Forget what the previous run's KV and index sources published (a run starts at layer 0)."""
        self.sparse = StaticSparse()
        self._compress_rows = None

    def compress(self, attn: Attention, x: torch.Tensor) -> None:
        """Every row's would-be group entry to its ``entry_slots`` (pool slot 0 where the row closes no
        group) and, for ratio 2, its fp32 (value, gate) to its slot's partial rows. x [G, D]."""
        r, cache = self.rows, self.cache
        keys = None
        if self.kernels is None:
            static_compress(
                attn, x, cache, r.state_slots, r.positions, r.entry_slots[attn.ratio], r.row_first, r.row_seqlens_k
            )
            epb = cache.layout.source(attn.layer).entries_per_block
            keys = read_keys(cache, attn.layer, r.block_tables, r.max_blocks * epb)
        else:
            # The static batch's requests (placeholder rows each their own). The kernel reads a group's
            # member before ``first`` from the partial row of p − 1, so placeholder rows (p = 0) act at
            # p = 1 (live rows have p ≥ 1: fill checks it), all inside the null slot 0 and block 0.
            if self._compress_rows is None:
                self._compress_rows = dict(
                    positions=r.positions.clamp_min(1), first=r.first.clamp_min(1), seqlens_k=r.seqlens_k.clamp_min(2)
                )
            batch = SimpleNamespace(
                **self._compress_rows,
                row_requests=r.row_requests,
                query_start=r.query_start,
                state_slots=r.request_slots,
                entry_writes={attn.ratio: (self._all_rows, r.entry_slots[attn.ratio])},
            )
            options = {"dot_fp32": True} if self.kernels.interpreted else {}
            self.kernels.compressor.compress_layer(cache, batch, attn, x, **options)
        self.sparse = StaticSparse(attn.ratio, attn.layer, keys)

    def select(self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor) -> None:
        ratio, sparse, r = attn.ratio, self.sparse, self.rows
        if sparse.ratio != ratio or sparse.source is None:
            raise ValueError(f"layer {attn.layer} needs a preceding KV source with ratio {ratio}")
        if attn.indexer is None:
            return  # reuse the nearest index source's selection
        epb = self.cache.layout.source(sparse.source).entries_per_block
        if self.kernels is None:
            visible = (r.positions + 1) // ratio  # [G]
            entries, candidates = static_index_select(
                attn, x, q_latent, angles, sparse.keys, visible, sparse.candidates
            )
        else:
            entries, candidates = self._index_kernel(attn, x, q_latent, angles, epb)
        slots_of = reference if self.kernels is None else self.kernels.entry_slots  # the same slots
        sparse.selected = slots_of.entry_slots(entries, r.block_tables, epb)  # int32 pool slots
        sparse.candidates = candidates

    def attend(self, attn: Attention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        r, cache = self.rows, self.cache
        # The ring now holds the row itself: the kernel writes the bytes of CacheEngine.write_window.
        if self.kernels is None:
            cache.write_window(attn.layer, r.state_slots, r.ring_slots, k)
        else:
            self.kernels.window_write.write_window(cache.ring(attn.layer), r.state_slots, r.ring_slots, k)
        pool, selected = self._no_pool, self._no_selection
        if attn.ratio:
            pool, selected = cache.entries(self.sparse.source)[0], self.sparse.selected
        args = (q, cache.ring(attn.layer), r.state_slots, r.positions, attn.window, pool, selected)
        if self.kernels is None:
            return static_attend(*args, attn.attn_sink, attn.freqs, attn.head_dim**-0.5)
        return self.kernels.decode_attention.sparse_decode_attention(
            q.contiguous(),
            *args[1:],
            attn.attn_sink.float(),
            attn.freqs,
            attn.head_dim**-0.5,
            dot_fp32=self._fp32_dots(q),
        )  # [G, H, hd], RoPE undone

    def _fp32_dots(self, q: torch.Tensor) -> bool:
        if self.kernels.interpreted:
            return True  # no bf16 tl.dot in the interpreter
        return q.dtype == torch.float32 if self.fp32_dots is None else self.fp32_dots

    def _index_kernel(
        self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor, entries_per_block: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``static_index_select`` by kernels/indexer.py over the same W = B · epb entries, the keys read
        from the pool through the block tables: (entry ids int32 [G, ≤topk] ascending, −1 = none; the
        candidate block mask uint8 [G, ⌈W/CB⌉] to carry, or None)."""
        idx, sparse, r = attn.indexer, self.sparse, self.rows
        query = index_query(idx, q_latent, angles, self.kernels.indexer_quant)  # [G, Hi, di], == quant's
        w, w_scale = index_weights(idx, x)  # [G, Hi]
        entries, picked = self.kernels.indexer.indexer_select(
            query.contiguous(),
            w,
            self.cache.entries(sparse.source)[1],
            r.block_tables,
            r.positions,
            attn.ratio,
            r.max_blocks * entries_per_block,
            index_topk=attn.index_topk,
            candidates=sparse.candidates if attn.uses_candidates else None,
            candidate_source=attn.is_candidate_source,
            candidate_block_size=attn.candidate_block_size,
            candidate_topk_blocks=attn.candidate_topk_blocks,
            dot_fp32=self.kernels.interpreted,
            w_scale=w_scale,
        )
        return entries, picked if attn.is_candidate_source else sparse.candidates


# ---- the "reference" path's static torch ops, over the G rows ----------------------------------------


def static_index_select(
    attn: Attention,
    x: torch.Tensor,
    q_latent: torch.Tensor,
    angles: torch.Tensor,
    keys: torch.Tensor,
    visible: torch.Tensor,
    candidates: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Indexer scores over each row's W entries, candidate blocks, top-k (model/deepseek_v41/indexer.py
    semantics, lower index first among ties). x [G, D], q_latent [G, q_lora], angles [G, P], keys
    [G, W, di], visible [G] → (entry ids [G, ≤topk] ascending, −1 = none; candidates [G, W] to carry)."""
    query = fake_quant_indexer(attn.indexer.query(q_latent, angles))  # [G, Hi, di]
    scores = attn.indexer.scores_quantized(query.unsqueeze(1), x.unsqueeze(1), keys, visible.unsqueeze(1))
    scores, candidates = attn.restrict_to_candidates(scores, visible.unsqueeze(1), candidates)  # [G, 1, W]
    return select_entries(scores, attn.index_topk)[:, 0], candidates


def static_compress(
    attn: Attention,
    x: torch.Tensor,
    cache: CacheEngine,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    entry_slots: torch.Tensor,
    first: torch.Tensor,
    seqlens_k: torch.Tensor,
) -> None:
    """Every row's would-be group entry (spec §3.6) to ``entry_slots`` (pool slot 0 where the row
    closes no group), and, for ratio 2, the row's fp32 (value, gate) to its slot's partial rows. The
    group's other member (position p − 1) is the previous row's when p − 1 ≥ the request's ``first``
    (a verify step's later rows), else the slot's partial row, read before this step's writes, as
    ``TorchAttention.write_groups`` orders them; only rows among their request's last ``size``
    positions write partial rows (the others the null slot 0), so writes never collide. x [G, D];
    state_slots, positions, first, seqlens_k [G] (the row's request's)."""
    comp, ratio, layer = attn.compressor, attn.ratio, attn.layer
    if ratio == 1:
        latent = comp.norm(F.linear(x, comp.wkv.weight.to(x.dtype)))  # [G, hd]
    else:
        values, gates = comp.project(x)  # [G, hd] fp32
        partial = cache.partial(layer)
        size = partial.shape[1]
        earlier = partial[state_slots, (positions - 1) % size]  # [G, 2, hd], read before the write
        in_step = (positions - 1 >= first).unsqueeze(-1)  # [G, 1]: p − 1 is the previous row (never for row 0)
        earlier_values = torch.where(in_step, values.roll(1, 0), earlier[:, 0])
        earlier_gates = torch.where(in_step, gates.roll(1, 0), earlier[:, 1])
        latent = comp.pool(torch.stack((earlier_values, values), 1), torch.stack((earlier_gates, gates), 1), x.dtype)
        tail = positions >= seqlens_k - size
        cache.write_partial(layer, torch.where(tail, state_slots, 0), positions, values, gates)
    angles = rope_angles(positions - ratio + 1, attn.freqs)  # at the group's first token
    idx = attn.indexer
    kv = apply_rope(latent, angles)
    keys = apply_rope(idx.k_norm(idx.wk(latent)), angles)
    cache.write_entries(layer, entry_slots, kv, keys)


def static_attend(
    q: torch.Tensor,
    ring: torch.Tensor,
    state_slots: torch.Tensor,
    positions: torch.Tensor,
    window: int,
    kv_pool: torch.Tensor,
    selected: torch.Tensor,
    sink: torch.Tensor,
    freqs: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Sparse decode attention over the ring (written this step) and the selected pool slots, sink
    and undo-RoPE: ``kernels.reference.sparse_decode_attention``'s contract (the "triton" path calls
    kernels/decode_attention.py's), computed in ``TorchAttention``'s ops: the same keys in the same
    order, the model's ``sink_attention``, then the model's undo-RoPE (``apply_rope``, which
    ``AttentionStep.project_out`` applies after ``TorchAttention``). So a decode row's output is the
    eager step's bit for bit; the kernel reference's cos/sin undo-RoPE rounds otherwise (up to 1 ulp),
    which the batch-invariant mode's ``==`` with the full forward does not allow."""
    keys, allowed = reference.decode_keys(q.shape[-1], ring, state_slots, positions, window, kv_pool, selected)
    out = sink_attention(q.unsqueeze(1), keys.to(q.dtype), allowed.unsqueeze(1), sink, scale)[:, 0]  # [G, H, hd]
    return apply_rope(out, rope_angles(positions, freqs), inverse=True)


def read_keys(cache: CacheEngine, layer: int, block_tables: torch.Tensor, width: int) -> torch.Tensor:
    """fp32 index keys [G, width, di] of entries 0…width−1 through each row's block table [G, B]
    (``CacheEngine.read_entries`` without the KV half, which only the attention reads)."""
    epb = cache.layout.source(layer).entries_per_block
    e = torch.arange(width, device=block_tables.device)
    raw = cache.entries(layer)[1][block_tables[:, e // epb], e % epb]  # [G, W, key bytes]
    half = cache.layout.index_head_dim // 2
    return dequantize_fp4_cache(raw[..., :half], raw[..., half:].view(torch.float8_e8m0fnu), INDEXER_BLOCK)
