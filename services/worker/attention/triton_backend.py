"""The kernel backend of ``AttentionStep``: any step's rows, with the compressor, indexer and attention in
Triton (kernels/compressor.py, indexer.py, decode_attention.py, prefill_attention.py; the window-K write
and the index query's FP4 rounding by window_write.py and indexer_quant.py where the kernel set has them),
reading the packed pools directly: no step of this backend dequantises the entry pool (``read_entries``).

- compressed layers: a KV source writes this step's complete groups with ``compress_layer`` (then the
  pool holds every entry a row may select); an index source selects with ``indexer_select`` from the
  FP4 index keys in the pool (the candidate source picks the candidate blocks that the layers using
  candidates score inside); a layer without an indexer reuses the nearest selection;
- attention: a decode-only step (one row per request) writes the rows' K to the window rings, then
  ``sparse_decode_attention`` reads ring and pool; any other step runs every row, decode rows
  included, through ``sparse_prefill_attention`` on the rings as they were before the step, then
  writes the rings (a chunk may overwrite ring positions its own first rows still read).

A rounding hook (the oracle harness's, tests only) rewrites the pre-rounding compressed entries, index
keys and index queries, which the fused kernels never expose: with a hook set, compression and
selection stay ``TorchAttention``'s (including its ``read_entries``); attention stays on the kernels. A
``KernelSet`` without compressor or indexer modules (the FP8 test's torch-reference set) takes the same
torch path.
"""

from __future__ import annotations

from types import ModuleType

import torch

from kernels.reference import entry_slots
from model.deepseek_v41.attention import Attention
from model.deepseek_v41.indexer import Indexer
from model.deepseek_v41.quant import fake_quant_indexer, quantize_fp8_cache
from model.deepseek_v41.rope import apply_rope_
from services.worker.attention.backend import StepRounding
from services.worker.attention.torch_backend import TorchAttention
from services.worker.batch.step_batch import StepBatch
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.state.cache_engine import CacheEngine


def index_query(idx: Indexer, q_latent: torch.Tensor, angles: torch.Tensor, quant: ModuleType | None) -> torch.Tensor:
    """The FP4-rounded index queries [R, Hi, di]: ``fake_quant_indexer(idx.query(q_latent, angles))``. With
    the kernel (``quant``: kernels/indexer_quant.py) and fp32 queries, the RoPE is done inside its launch
    (the same bits: one launch fewer); angles are the rows' turns complex [R, P] or fp32 angles."""
    if quant is None:
        return fake_quant_indexer(idx.query(q_latent, angles))
    raw = idx.wq_b(q_latent).unflatten(-1, (idx.num_heads, idx.head_dim))  # [R, Hi, di], not rotated
    if raw.dtype == torch.float32 and angles.dtype == torch.complex64 and raw.ndim == 3 and angles.ndim == 2:
        return quant.fake_quant_indexer(raw, angles)
    return quant.fake_quant_indexer(apply_rope_(raw, angles))


def index_weights(idx: Indexer, x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(w, w_scale) for ``kernels.indexer.indexer_select``: fp32 head weights ``weights_proj(x)`` [R, Hi] with
    ``scores_quantized``'s scale left for the kernel to multiply as it loads w (its fp32 product has torch's
    bits: one launch fewer), or, where ``weights_proj`` returns another dtype (its product rounds in that
    dtype), torch's product in fp32 and w_scale 1."""
    w = idx.weights_proj(x)  # [R, Hi]
    if w.dtype == torch.float32:
        return w, idx.weight_scale
    return (w * idx.weight_scale).float(), 1.0


STAGE_MAX_ENTRIES = 1 << 16
"""Prefill attention reads compressed entries dequantised once per step (``stage_entries``) when the
step's requests hold at most this many at the source (64 MB of bf16 keys at head_dim 512, plus the
dequantisation's transient): faster than dequantising in the loop at 1K–4K-token chunks
(the kernel bench: docs/performance.md, "Kernels"). Above it (many long requests in one mixed step) the loop
dequantises, as before."""

STAGE_MAX_WINDOW_ROWS = 1 << 16
"""Prefill attention reads each layer's window keys dequantised once per step (``stage_window``: every
step row plus each request's window − 1 ring rows before it) when there are at most this many (64 MB of
bf16 keys at head_dim 512), instead of dequantising each key in the loop of every row whose window
holds it (up to window rows); the same bits either way. Above it (hundreds of requests in one mixed
step) the loop dequantises."""


class TritonAttention:
    undoes_rope = True  # the attention kernels' contract

    def __init__(
        self,
        cache: CacheEngine,
        batch: StepBatch,
        kernels: KernelSet,
        precision: str,
        rounding: StepRounding | None = None,
    ) -> None:
        self.cache, self.b, self.kernels = cache, batch, kernels
        self.fp32_dots = precision == "fp32" or kernels.interpreted  # no bf16/f16 tl.dot in the interpreter
        b = batch
        if b.decode_only is not None:  # known on the host: no device read
            self.all_decode = b.decode_only
        else:
            self.all_decode = bool(((b.query_start[1:] - b.query_start[:-1]) == 1).all())
        self.row_slots = b.state_slots[b.row_requests]  # [R]
        # [R] the ring slot each row writes: its own where it is among its request's last ring_size positions,
        # the null slot 0 otherwise (a boolean-mask selection would read its count back: a stream sync per use).
        self.ring_write_slots = (
            None if self.all_decode else torch.where(b.tail(cache.layout.ring_size), self.row_slots, 0)
        )
        self.row_first = None if self.all_decode else b.row_first()  # [R] each row's request's first position
        self.row_tables = b.block_tables[b.row_requests]  # [R, width] each row's request's table
        rounding = rounding or StepRounding()
        # The torch path of compression and selection (see the module docstring), or None.
        self.torch_sparse = (
            TorchAttention(cache, batch, rounding)
            if (rounding.active or kernels.compressor is None or kernels.indexer is None)
            else None
        )
        # What the nearest KV / index sources published (spec §3.4):
        self.source: int | None = None  # the KV source layer whose pool the following layers read
        self.ratio = 0
        self.width = 0  # entries 0 … W−1 of every request (W = max ⌊seqlen_k / ratio⌋)
        self.selected: torch.Tensor | None = None  # [R, ≤topk] entry ids ascending, −1 = none
        self.candidates: torch.Tensor | None = None  # uint8 [R, ceil(W / CB)] candidate blocks
        self._no_entries: torch.Tensor | None = None
        self._stage_keys: torch.Tensor | None = None  # _staged's keys, of the source _stage_source
        self._stage_source: int | None = None

    # ---- compressed entries and selection ------------------------------------------------------

    def compress(self, attn: Attention, x: torch.Tensor) -> None:
        if self.torch_sparse is not None:
            self.torch_sparse.compress(attn, x)
            self.source = attn.layer
            return
        self.kernels.compressor.compress_layer(self.cache, self.b, attn, x, dot_fp32=self.fp32_dots or None)
        self.source, self.ratio, self.candidates = attn.layer, attn.ratio, None
        self.width = self.b.max_entries(attn.ratio)  # the eager backend's width (a host fact: no sync)

    def select(self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor) -> None:
        """Updates selected / candidates for this compressed layer."""
        b, ratio = self.b, attn.ratio
        if self.torch_sparse is not None:
            self.torch_sparse.select(attn, x, q_latent, angles)
            self.selected = self.torch_sparse.sparse.selected[:, 0]  # [R, k]
            return
        if self.ratio != ratio or self.source is None:
            raise ValueError(f"layer {attn.layer} needs a preceding KV source with ratio {ratio}")
        if attn.indexer is None:
            return  # reuse the nearest index source's selection
        if attn.uses_candidates and not attn.is_candidate_source and self.candidates is None:
            raise ValueError(f"layer {attn.layer} uses candidates but no candidate source precedes it")
        idx = attn.indexer
        # FP4-rounded as TorchAttention.select rounds it (the kernel's bits are the same).
        query = index_query(idx, q_latent, angles, self.kernels.indexer_quant)  # [R, Hi, di]
        w, w_scale = index_weights(idx, x)  # [R, Hi]
        selected, candidates = self.kernels.indexer.indexer_select(
            query,
            w,
            self.cache.entries(self.source)[1],
            self.row_tables,
            b.positions,
            ratio,
            self.width,
            index_topk=attn.index_topk,
            candidates=self.candidates if attn.uses_candidates else None,
            candidate_source=attn.is_candidate_source,
            candidate_block_size=attn.candidate_block_size,
            candidate_topk_blocks=attn.candidate_topk_blocks,
            # [R, min(k, W rounded up to a power of two)], −1 padded: the attention kernels' TOPK constexpr then
            # takes one value per power of two of the context, not one per width (docs/performance.md).
            select_width=min(attn.index_topk, 1 << (self.width - 1).bit_length()) if self.width else 0,
            dot_fp32=self.kernels.interpreted,
            w_scale=w_scale,
        )
        self.selected = selected
        if attn.is_candidate_source:
            self.candidates = candidates

    def _entries(self, attn: Attention, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(compressed-KV pool, selected pool slots int32 [R, k]) for this layer; an empty selection
        and a one-entry dummy pool for window-only layers."""
        cache = self.cache
        if attn.ratio:
            epb = cache.layout.source(self.source).entries_per_block
            slots_of = self.kernels.entry_slots  # the same slots as kernels.reference's, in one launch
            slots = (entry_slots if slots_of is None else slots_of.entry_slots)(self.selected, self.row_tables, epb)
            return cache.entries(self.source)[0], slots
        if self._no_entries is None:
            self._no_entries = torch.zeros(1, 1, cache.layout.kv_entry_bytes, dtype=torch.uint8, device=device)
        return self._no_entries, torch.empty(self.b.num_rows, 0, dtype=torch.int32, device=device)

    # ---- attention --------------------------------------------------------------------------------

    def attend(self, attn: Attention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        b, layer = self.b, attn.layer
        if self.all_decode:
            self._write_window(layer, self.row_slots, b.ring_slots, k)  # every row is its request's last
            return self._decode(attn, q.contiguous())
        out = self._prefill(attn, q.contiguous(), k)  # reads the rings before this step's writes
        self._write_window(layer, self.ring_write_slots, b.ring_slots, k)
        return out

    def _write_window(self, layer: int, slots: torch.Tensor, ring_slots: torch.Tensor, k: torch.Tensor) -> None:
        """``CacheEngine.write_window``, by the kernel set's window_write where it has one (the same bytes)."""
        if self.kernels.window_write is None:
            self.cache.write_window(layer, slots, ring_slots, k)
        else:
            self.kernels.window_write.write_window(self.cache.ring(layer), slots, ring_slots, k)

    def _decode(self, attn: Attention, q: torch.Tensor) -> torch.Tensor:
        """Every row is a decode row and the rings already hold it: [R, H, hd], RoPE undone."""
        b = self.b
        pool, selected = self._entries(attn, q.device)
        return self.kernels.decode_attention.sparse_decode_attention(
            q,
            self.cache.ring(attn.layer),
            self.row_slots,
            b.positions,
            attn.window,
            pool,
            selected,
            attn.attn_sink,
            attn.freqs,
            attn.head_dim**-0.5,
            dot_fp32=self.fp32_dots,
        )

    def _prefill(self, attn: Attention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Rows of prefill chunks (and one-row requests among them) over the rings as before this step
        and this step's K rows (their FP8 bytes, as the rings will hold them): [R, H, hd], RoPE undone."""
        b = self.b
        staged = self._staged(attn)
        if staged is None:
            pool, selected = self._entries(attn, q.device)
        else:
            pool, selected = staged
        step_k, ring = quantize_fp8_cache(k), self.cache.ring(attn.layer)
        return self.kernels.prefill_attention.sparse_prefill_attention(
            q,
            step_k,
            ring,
            self.row_slots,
            b.positions,
            self.row_first,
            attn.window,
            pool,
            selected,
            attn.attn_sink,
            attn.freqs,
            attn.head_dim**-0.5,
            dot_fp32=self.fp32_dots,
            staged=None if staged is None else pool,
            staged_window=self._staged_window(attn, step_k, ring),
        )

    def _staged_window(
        self, attn: Attention, step_k: tuple[torch.Tensor, torch.Tensor], ring: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys, rows): this layer's window keys dequantised once for the step (``stage_window``; the
        layer's own K rows and ring, read before this step writes it), or None for kernel sets without
        it and steps of more than STAGE_MAX_WINDOW_ROWS keys. Host facts only: graph-safe."""
        module, b = self.kernels.prefill_attention, self.b
        if (
            not hasattr(module, "stage_window")
            or b.num_rows + b.num_requests * (attn.window - 1) > STAGE_MAX_WINDOW_ROWS
        ):
            return None
        dtype = torch.float32 if self.fp32_dots else torch.bfloat16  # the kernel's key dtype
        return module.stage_window(
            step_k,
            ring,
            self.row_slots,
            b.positions,
            self.row_first,
            attn.window,
            b.row_requests,
            b.num_requests,
            dtype,
        )

    def _staged(self, attn: Attention) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(keys [E, hd], rows of them int32 [R, k]): the entries this step's requests can select at the
        current source, dequantised once per source (``stage_keys``; exact in bf16) and shared by the
        layers that read it; None when staging does not apply (window-only layers, the torch sparse
        path, kernel sets without it, or more than STAGE_MAX_ENTRIES entries to dequantise)."""
        module = self.kernels.prefill_attention
        if (
            not attn.ratio
            or self.torch_sparse is not None
            or not hasattr(module, "stage_keys")
            or self.selected is None
        ):
            return None
        b, cache = self.b, self.cache
        epb = cache.layout.source(self.source).entries_per_block
        tables = b.block_tables[:, : -(-self.width // epb)]  # [N, blocks holding entries 0 … W−1]
        if not self.width or tables.numel() * epb > STAGE_MAX_ENTRIES:
            return None
        if self._stage_source != self.source:  # the source's entries are final once it has compressed
            dtype = torch.float32 if self.fp32_dots else torch.bfloat16
            self._stage_keys = module.stage_keys(cache.entries(self.source)[0], tables, dtype)
            self._stage_source = self.source
        return self._stage_keys, module.stage_rows(self.selected, b.row_requests, tables.shape[1] * epb)
