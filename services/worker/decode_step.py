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
q_norm, wq_b, wkv, kv_norm, compressor, indexer, ``_project_out`` or the kernel backend's grouped
``wo_a``; ``Block.run`` for Engram, mHC and MoE), so a kernel backend's swapped modules drop in. Decode makes the cached step simpler:
the window ring is written first and then read whole (it holds the current row), a ratio-2 group's
other member is always in the slot's fp32 partial rows, and the indexer scores a fixed width of
``max_blocks_per_request · entries per block`` entries gathered from the pool through the block
tables, masked at each row's visible count.

``attention`` picks the path of the three ops that want kernels: "triton" runs kernels/compressor.py
``compress``, kernels/indexer.py ``indexer_select`` (FP4 keys read straight from the pool) and
kernels/decode_attention.py (CUDA, or interpreted copies for CPU tests); "reference" runs the static
torch versions in decode_step_ops.py (``compress``, ``index_select``, ``attend``: CPU tests, bit-identity with
CachedStep). The MoE routes placeholder rows nowhere: ``KernelMoE`` takes the live-row mask (graph-
safe); the torch MoE, whose expert loop syncs with the host and so is never captured, runs on the
live rows only (a prefix) and pads its output back.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from dataclasses import dataclass
from types import ModuleType, SimpleNamespace

import torch
import torch.nn.functional as F

from kernels.device import upload_into
from model.deepseek_v41.attention import Attention
from model.deepseek_v41.mhc import collapse, initial_pre
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.quant import fake_quant_indexer
from model.deepseek_v41.rope import apply_rope, apply_rope_, rope_angles
from scheduler_rs import StepPlan
from services.worker.cache_engine import CacheEngine
from services.worker.kernel_head import head_logits
from services.worker.kernel_moe import KernelMoE
from services.worker import decode_step_ops as ops
from services.worker.step_batch import PendingInputs, StepBatch, apply_pending, check_ring_slots, pending_rows

ATTENTION = ("reference", "triton")  # kernels.reference.sparse_decode_attention / kernels.decode_attention


@dataclass
class _Sparse:
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
            raise ValueError(f"the interpreted kernel set has no {name}: load it too (tests/kernels/interpret.py)")
        return found if found is not None else importlib.import_module(f"kernels.{name}")

    return SimpleNamespace(decode_attention=module("decode_attention"), compressor=module("compressor"),
                           indexer=module("indexer"), interpreted=interpreted)


class StaticDecodeStep:
    def __init__(self, model: DeepseekV41, cache: CacheEngine, num_rows: int, max_blocks_per_request: int, *,
                 attention: str, kernels: object | None = None, fp32_dots: bool | None = None) -> None:
        """``kernels``: a KernelSet for the "triton" path (see ``step_kernels``); unused by "reference".
        ``fp32_dots``: the attention kernel's dot precision, as the eager ``KernelStep`` picks it
        (precision "fp32" or interpreted kernels); None = fp32 for fp32 queries. Graph and eager steps
        must use the same, or the FP8 path's roundings diverge between them."""
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.model, self.cache, self.cfg = model, cache, model.cfg
        self.attention = attention
        self.kernels = step_kernels(kernels) if attention == "triton" else None
        self.fp32_dots = fp32_dots
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
        self.live = zeros(num_rows, dtype=torch.bool)  # [G] real rows: a prefix (count towards experts)
        ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids})
        # ratio → [G] pool slot of the entry the row's group closes; 0 (the null block) for no entry.
        self.entry_slots = {r: zeros(num_rows) for r in ratios}
        self.num_live = 0  # host copy of the real rows, for trimming
        hd = cfg.head_dim
        self._no_pool = torch.zeros(1, 1, hd // 2 + hd // 16, dtype=torch.uint8, device=device)  # ratio-0 layers
        self._no_selection = torch.zeros(num_rows, 0, dtype=torch.int32, device=device)
        self._rows = torch.arange(num_rows, device=device)  # [G]: row i is request i
        self._query_start = torch.arange(num_rows + 1, device=device)  # [G+1]

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
        check_ring_slots(plan, self.cache.layout.ring_size)
        batch = StepBatch.from_plan(plan, "cpu")
        if int(batch.positions.min()) < 1:  # the compressor reads position p − 1's partial row
            raise ValueError("a decode row at position 0 (a request without a prompt)")

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat((x, x.new_zeros(g - n, *x.shape[1:])))

        # Enqueued, not synchronised: the step in flight (async scheduling) may still be reading these
        # buffers, and the copies run after it in stream order.
        upload_into(self.input_ids, padded(batch.input_ids))
        upload_into(self.positions, padded(batch.positions))
        upload_into(self.state_slots, padded(batch.state_slots))
        upload_into(self.ring_slots, padded(batch.ring_slots))
        tables = torch.zeros(g, self.max_blocks, dtype=torch.long)
        tables[:n, : plan.block_table_width] = batch.block_tables
        upload_into(self.block_tables, tables)
        upload_into(self.live, torch.arange(g) < n)
        for ratio, buf in self.entry_slots.items():
            rows, slots = batch.entry_writes.get(ratio, (torch.zeros(0, dtype=torch.long),) * 2)
            host = torch.zeros(g, dtype=torch.long)
            host[rows] = slots
            upload_into(buf, host)
        if pending is not None:  # on the device, from the step in flight's tokens (never read back)
            where = pending_rows(plan, pending)
            if where is not None:
                apply_pending(self.input_ids, *where, pending.token_ids)
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
        for block in self.model.layers:
            def attend(x: torch.Tensor, attn: Attention = block.attn) -> torch.Tensor:
                return self._attend_layer(attn, x[0]).unsqueeze(0)

            with self._live_rows(block.ffn, counts[block.layer]):
                h, pre = block.run(h, pre, attend, engram_rows, None, None)
        y = model.norm(collapse(h, pre))[0]  # [G, D]
        return head_logits(model.head, y), counts

    @contextlib.contextmanager
    def _live_rows(self, ffn: torch.nn.Module, counts: torch.Tensor) -> Iterator[None]:
        """``Block.run`` calls ``ffn(x, None)``, x [1, G, D]: these hooks route the live rows only and
        count them into ``counts`` [E]. ``KernelMoE`` takes the row mask; the torch MoE runs on the
        live prefix and its output is padded back with zeros (shapes vary: never captured)."""
        if isinstance(ffn, KernelMoE):
            hooks = [ffn.register_forward_pre_hook(lambda _m, args, _kw: ((args[0], counts), {"live": self.live}),
                                                   with_kwargs=True)]
        else:
            n, pad = self.num_live, self.num_rows - self.num_live
            hooks = [ffn.register_forward_pre_hook(lambda _m, args: (args[0][:, :n], counts)),
                     ffn.register_forward_hook(lambda _m, _args, out: F.pad(out, (0, 0, 0, pad)))]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()

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
        q = apply_rope_(attn.wq_b(q_latent).unflatten(-1, (attn.num_heads, attn.head_dim)), angles)  # [G, H, hd]
        k = apply_rope(attn.kv_norm(attn.wkv(x)), angles)  # [G, hd]
        cache.write_window(layer, self.state_slots, self.ring_slots, k)  # the ring now holds the row itself
        pool, selected = self._no_pool, self._no_selection
        if attn.ratio:
            self._sparse_layer(attn, x, q_latent, angles)
            pool, selected = cache.entries(self.sparse.source)[0], self.sparse.selected
        args = (q, cache.ring(layer), self.state_slots, self.positions, attn.window, pool, selected)
        if self.kernels is not None:
            out = self.kernels.decode_attention.sparse_decode_attention(
                q.contiguous(), *args[1:], attn.attn_sink.float(), attn.freqs, attn.head_dim**-0.5,
                dot_fp32=self._fp32_dots(q))  # [G, H, hd], RoPE undone
        else:
            out = ops.attend(*args, attn.attn_sink, attn.freqs, attn.head_dim**-0.5)
        if isinstance(attn.wo_a, torch.nn.Linear):  # the model's projection (angle 0: RoPE already undone)
            return attn._project_out(out.unsqueeze(1), torch.zeros_like(angles).unsqueeze(1))[:, 0]
        return attn.wo_b(attn.wo_a(out.reshape(out.shape[0], attn.num_groups, -1)))  # the kernel backend's

    def _sparse_layer(self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor) -> None:
        ratio, cache = attn.ratio, self.cache
        if attn.compressor is not None:
            self._compress(attn, x)
            keys = None
            if self.kernels is None:
                epb = cache.layout.source(attn.layer).entries_per_block
                keys = ops.read_keys(cache, attn.layer, self.block_tables, self.max_blocks * epb)
            self.sparse = _Sparse(ratio, attn.layer, keys)
        sparse = self.sparse
        if sparse.ratio != ratio or sparse.source is None:
            raise ValueError(f"layer {attn.layer} needs a preceding KV source with ratio {ratio}")
        if attn.indexer is None:
            return  # reuse the nearest index source's selection
        epb = cache.layout.source(sparse.source).entries_per_block
        if self.kernels is None:
            visible = (self.positions + 1) // ratio  # [G]
            entries, candidates = ops.index_select(attn, x, q_latent, angles, sparse.keys, visible, sparse.candidates)
        else:
            entries, candidates = self._index_kernel(attn, x, q_latent, angles, epb)
        sparse.selected = ops.entry_slots_of(entries, self.block_tables, epb)
        sparse.candidates = candidates

    def _compress(self, attn: Attention, x: torch.Tensor) -> None:
        """Every row's would-be group entry to its ``entry_slots`` (pool slot 0 where the row closes no
        group) and, for ratio 2, its fp32 (value, gate) to its slot's partial rows. x [G, D]."""
        if self.kernels is None:
            ops.compress(attn, x, self.cache, self.state_slots, self.positions, self.entry_slots[attn.ratio])
            return
        # Each row is its own request, its first and last position this step; the kernel reads the
        # group's other member from the partial row of p − 1, so placeholder rows (p = 0) act at p = 1
        # (live rows have p ≥ 1: prepare checks it), all inside the null slot 0 and block 0.
        pos = self.positions.clamp_min(1)  # [G]
        batch = SimpleNamespace(positions=pos, row_requests=self._rows, first=pos, query_start=self._query_start,
                                seqlens_k=pos + 1, state_slots=self.state_slots,
                                entry_writes={attn.ratio: (self._rows, self.entry_slots[attn.ratio])})
        options = {"dot_fp32": True} if self.kernels.interpreted else {}
        self.kernels.compressor.compress_layer(self.cache, batch, attn, x, **options)

    def _fp32_dots(self, q: torch.Tensor) -> bool:
        if self.kernels.interpreted:
            return True  # no bf16 tl.dot in the interpreter
        return q.dtype == torch.float32 if self.fp32_dots is None else self.fp32_dots

    def _index_kernel(self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor,
                      entries_per_block: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_index_select`` by kernels/indexer.py over the same W = B · epb entries, the keys read from
        the pool through the block tables: (entry ids int32 [G, ≤topk] ascending, −1 = none; the
        candidate block mask uint8 [G, ⌈W/CB⌉] to carry, or None)."""
        idx, sparse = attn.indexer, self.sparse
        query = fake_quant_indexer(idx.query(q_latent, angles))  # [G, Hi, di]
        w = idx.weights_proj(x) * (idx.head_dim**-0.5 * idx.num_heads**-0.5)  # [G, Hi], as scores_quantized
        entries, picked = self.kernels.indexer.indexer_select(
            query.contiguous(), w.float(), self.cache.entries(sparse.source)[1], self.block_tables, self.positions,
            attn.ratio, self.max_blocks * entries_per_block, index_topk=attn.index_topk,
            candidates=sparse.candidates if attn.uses_candidates else None,
            candidate_source=attn.is_candidate_source, candidate_block_size=attn.candidate_block_size,
            candidate_topk_blocks=attn.candidate_topk_blocks, dot_fp32=self.kernels.interpreted)
        return entries, picked if attn.is_candidate_source else sparse.candidates
