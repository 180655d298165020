"""The worker's two cache pools, as real packed bytes (walkthrough Pass 2, Thread 2; spec §3.14).

Paged blocks (``blocks``: uint8 [num_blocks, bytes_per_block]); block 0 is the null block. One block
covers ``block_size`` token positions of every KV source, laid out source after source; a source of
ratio r holds ``block_size / r`` entries, first all compressed-KV entries, then all index keys:

    compressed-KV entry  head_dim/2 bytes of FP4 e2m1 (even channel in the low nibble)
                         + head_dim/16 e4m3 scales                        Flash: 256 + 32 = 288 B
    index key            index_head_dim/2 bytes of FP4 + index_head_dim/32 e8m0 scales   64 + 4 = 68 B

Entry e of a request lives in block ``block_table[e // epb]`` at offset ``e % epb`` (the scheduler's
``entry_writes`` slot = block_id · epb + e mod epb).

State slots (``slots``: uint8 [num_state_slots, bytes_per_slot]); slot 0 is the null slot. One slot
holds everything else a request carries between steps, each part indexed by position modulo its size,
so no part ever shifts and a rejected draft only dirties entries that are rewritten before any read:

    per layer       FP8 window ring: ring_size × (head_dim e4m3 + head_dim/32 e8m0)   Flash 134 × 528 B
    per ratio-2     partial group: (ratio − 1 + spare) rows of fp32 (value, gate), 2·head_dim·4 bytes
    KV source       each (spare = ring_size − window, the window ring's backtracking room)
    Engram          (max_ngram − 1 + spare) compressed token ids, int32
    DSpark draft    per stage, the draft's context K=V of the last W (= window) positions, fp32
    (with drafts)   [W, head_dim] at column position mod W; only accepted positions are written, in
                    order, so it needs no backtracking room: a block anchored at A reads A − W … A − 1,
                    every one of them (≥ 0) written by the slot's request since its prompt's start

The number of emitted groups is not stored: it is ⌊position / ratio⌋, and the plan carries positions.
``dequantize(quantize(x))`` equals the model's fake quantisation bit for bit (``quant.py``), so a read
gives exactly the values the full-sequence forward uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.quant import (
    COMPRESSED_KV_BLOCK,
    FP8_CACHE_BLOCK,
    INDEXER_BLOCK,
    dequantize_fp4_cache,
    dequantize_fp8_cache,
    quantize_fp4_cache,
    quantize_fp8_cache,
)

log = logging.getLogger(__name__)

MIN_BACKTRACK = 6  # DeepInfer's DEEPINFER_MAX_BACKTRACKING_TOKENS floor


def ring_size(cfg: ModelConfig, nextn: int = 0) -> int:
    """Window ring positions: window + max(6, nextn + 1) (the scheduler's ``SchedulerConfig.ring_size``)."""
    return cfg.sliding_window + max(MIN_BACKTRACK, nextn + 1)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SourceLayout:
    layer: int
    ratio: int
    entries_per_block: int
    kv_offset: int  # byte offset of the compressed-KV entries inside a block
    key_offset: int  # byte offset of the index keys inside a block
    partial_rows: int  # fp32 (value, gate) rows in a state slot; 0 for ratio 1
    partial_offset: int  # byte offset inside a state slot


@dataclass(frozen=True)
class CacheLayout:
    """Byte layout of one block and one state slot for a model config."""

    block_size: int
    ring_size: int
    head_dim: int
    index_head_dim: int
    kv_entry_bytes: int
    key_bytes: int
    window_bytes: int  # one ring position
    sources: tuple[SourceLayout, ...]
    bytes_per_block: int
    num_layers: int
    ring_offset: int  # layer ℓ's ring starts at ring_offset + ℓ · ring_size · window_bytes
    engram_history: int  # compressed ids kept; 0 without Engram
    engram_offset: int
    draft_stages: int  # DSpark stages whose context K=V a slot holds; 0 without speculative decoding
    draft_window: int  # positions of the draft's context ring (the sliding window W)
    draft_offset: int  # byte offset of the draft's rings inside a state slot
    bytes_per_slot: int

    @staticmethod
    def build(cfg: ModelConfig, block_size: int, ring: int, draft: bool = False) -> CacheLayout:
        """``draft``: state slots also hold the DSpark draft's context K=V (speculative decoding)."""
        hd, di = cfg.head_dim, cfg.index_head_dim
        kv_entry = hd // 2 + _ceil_div(hd, COMPRESSED_KV_BLOCK)
        key = di // 2 + _ceil_div(di, INDEXER_BLOCK)
        window = hd + _ceil_div(hd, FP8_CACHE_BLOCK)
        spare = ring - cfg.sliding_window
        if spare < 1:
            raise ValueError(f"ring of {ring} positions leaves no room past the window of {cfg.sliding_window}")
        num_layers = cfg.num_hidden_layers
        # The rings come first; fp32/int32 parts start 4-byte aligned (no padding for Flash or tiny).
        slot_offset = _ceil_div(num_layers * ring * window, 4) * 4
        block_offset = 0
        sources = []
        for layer in cfg.kv_source_layer_ids:
            r = cfg.ratio(layer)
            if block_size % r:
                raise ValueError(f"block_size {block_size} is not a multiple of layer {layer}'s ratio {r}")
            epb = block_size // r
            rows = r - 1 + spare if r > 1 else 0
            sources.append(SourceLayout(layer, r, epb, block_offset, block_offset + epb * kv_entry, rows, slot_offset))
            block_offset += epb * (kv_entry + key)
            slot_offset += rows * 2 * hd * 4
        history = cfg.engram_max_ngram_size - 1 + spare if cfg.engram_layer_ids else 0
        draft_stages = cfg.num_nextn_predict_layers if draft else 0
        draft_offset = slot_offset + history * 4
        draft_bytes = draft_stages * cfg.sliding_window * hd * 4
        return CacheLayout(
            block_size,
            ring,
            hd,
            di,
            kv_entry,
            key,
            window,
            tuple(sources),
            block_offset,
            num_layers,
            0,
            history,
            slot_offset,
            draft_stages,
            cfg.sliding_window,
            draft_offset,
            draft_offset + draft_bytes,
        )

    def source(self, layer: int) -> SourceLayout:
        return next(s for s in self.sources if s.layer == layer)

    def describe(self) -> str:
        parts = " + ".join(f"{s.entries_per_block}·{self.kv_entry_bytes + self.key_bytes}" for s in self.sources)
        partial = sum(s.partial_rows * 2 * self.head_dim * 4 for s in self.sources)
        return (
            f"{self.bytes_per_block:,} bytes per {self.block_size}-token block ({parts}; "
            f"{self.bytes_per_block / self.block_size:g} per token); {self.bytes_per_slot:,} bytes per state "
            f"slot ({self.num_layers} rings × {self.ring_size} × {self.window_bytes} + {partial:,} partial "
            f"groups + {self.engram_history * 4} Engram history"
            + (
                f" + {self.draft_stages} draft rings × {self.draft_window} × {self.head_dim * 4}"
                if self.draft_stages
                else ""
            )
            + ")"
        )


def cache_bytes(cfg: ModelConfig, block_size: int, nextn: int = 0) -> tuple[int, int]:
    """(bytes per block, bytes per state slot) for any config; ``nextn`` > 0 (speculative decoding) adds the
    draft's rings to a slot. Flash at 128: (113,920, 2,916,132)."""
    layout = CacheLayout.build(cfg, block_size, ring_size(cfg, nextn), draft=nextn > 0)
    return layout.bytes_per_block, layout.bytes_per_slot


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class CacheEngine:
    """Both pools plus typed reads and writes. Index arguments are int64 tensors of equal length."""

    def __init__(
        self,
        cfg: ModelConfig,
        block_size: int,
        num_blocks: int,
        num_state_slots: int,
        ring: int,
        device: torch.device | str = "cpu",
        draft: bool = False,
    ) -> None:
        """``draft``: state slots also hold the DSpark draft's context rings (``draft_ring``)."""
        self.layout = CacheLayout.build(cfg, block_size, ring, draft)
        self.blocks = torch.zeros(num_blocks, self.layout.bytes_per_block, dtype=torch.uint8, device=device)
        self.slots = torch.zeros(num_state_slots, self.layout.bytes_per_slot, dtype=torch.uint8, device=device)
        log.info(
            "cache: %s; %d blocks (%.1f MB), %d state slots (%.1f MB)",
            self.layout.describe(),
            num_blocks,
            self.blocks.numel() / 1e6,
            num_state_slots,
            self.slots.numel() / 1e6,
        )

    # ---- views: [pool rows, items, item bytes] over the byte pools (no copies) --------------

    def _block_view(self, offset: int, items: int, item_bytes: int) -> torch.Tensor:
        return self.blocks[:, offset : offset + items * item_bytes].view(-1, items, item_bytes)

    def _slot_view(self, offset: int, items: int, item_bytes: int) -> torch.Tensor:
        return self.slots[:, offset : offset + items * item_bytes].view(-1, items, item_bytes)

    def ring(self, layer: int) -> torch.Tensor:
        """uint8 [num_state_slots, ring_size, window_bytes]."""
        lay = self.layout
        return self._slot_view(
            lay.ring_offset + layer * lay.ring_size * lay.window_bytes, lay.ring_size, lay.window_bytes
        )

    def entries(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Source ``layer``'s (compressed KV, index keys): uint8 [num_blocks, epb, entry bytes] each."""
        s, lay = self.layout.source(layer), self.layout
        return (
            self._block_view(s.kv_offset, s.entries_per_block, lay.kv_entry_bytes),
            self._block_view(s.key_offset, s.entries_per_block, lay.key_bytes),
        )

    # ---- window rings ------------------------------------------------------------------------

    def write_window(self, layer: int, slots: torch.Tensor, ring_slots: torch.Tensor, k: torch.Tensor) -> None:
        """k [N, head_dim] (post-RoPE, pre-rounding) → FP8 bytes at (state slot, ring slot)."""
        q, scale = quantize_fp8_cache(k)
        self.ring(layer)[slots, ring_slots] = torch.cat((_bytes(q), _bytes(scale)), dim=-1)

    def read_window(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """fp32 [N, ring_size, head_dim]: every ring position of these state slots, dequantised."""
        raw = self.ring(layer)[slots]
        hd = self.layout.head_dim
        return dequantize_fp8_cache(raw[..., :hd].view(torch.float8_e4m3fn), raw[..., hd:].view(torch.float8_e8m0fnu))

    # ---- compressed entries and index keys (paged) ------------------------------------------

    def write_entries(self, layer: int, slots: torch.Tensor, kv: torch.Tensor, keys: torch.Tensor) -> None:
        """kv [N, head_dim], keys [N, index_head_dim] (pre-rounding) at the plan's entry slots."""
        epb = self.layout.source(layer).entries_per_block
        block, offset = slots // epb, slots % epb
        kv_pool, key_pool = self.entries(layer)
        packed, scale = quantize_fp4_cache(kv, COMPRESSED_KV_BLOCK, "e4m3")
        kv_pool[block, offset] = torch.cat((packed, _bytes(scale)), dim=-1)
        packed, scale = quantize_fp4_cache(keys, INDEXER_BLOCK, "e8m0")
        key_pool[block, offset] = torch.cat((packed, _bytes(scale)), dim=-1)

    def read_entries(
        self, layer: int, block_tables: torch.Tensor, num_entries: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``num_entries`` entries of each request: block_tables [N, width] →
        (kv fp32 [N, num_entries, head_dim], keys fp32 [N, num_entries, index_head_dim])."""
        epb = self.layout.source(layer).entries_per_block
        e = torch.arange(num_entries, device=block_tables.device)
        blocks = block_tables[:, e // epb]  # [N, W]
        kv_pool, key_pool = self.entries(layer)
        kv_raw, key_raw = kv_pool[blocks, e % epb], key_pool[blocks, e % epb]
        half, key_half = self.layout.head_dim // 2, self.layout.index_head_dim // 2
        kv = dequantize_fp4_cache(kv_raw[..., :half], kv_raw[..., half:].view(torch.float8_e4m3fn), COMPRESSED_KV_BLOCK)
        keys = dequantize_fp4_cache(
            key_raw[..., :key_half], key_raw[..., key_half:].view(torch.float8_e8m0fnu), INDEXER_BLOCK
        )
        return kv, keys

    # ---- compressor partial groups (fp32) ----------------------------------------------------

    def partial(self, layer: int) -> torch.Tensor:
        """fp32 [num_state_slots, partial_rows, 2, head_dim]: (value, gate) of position p at row p mod rows."""
        s, hd = self.layout.source(layer), self.layout.head_dim
        return self._slot_view(s.partial_offset, s.partial_rows, 2 * hd * 4).view(torch.float32).unflatten(-1, (2, hd))

    def write_partial(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, gates: torch.Tensor
    ) -> None:
        view = self.partial(layer)
        view[slots, positions % view.shape[1]] = torch.stack((values.float(), gates.float()), dim=1)

    # ---- Engram history ----------------------------------------------------------------------

    def engram_history(self) -> torch.Tensor:
        """int32 [num_state_slots, engram_history]: the compressed id of position p at column p mod size."""
        lay = self.layout
        return self.slots[:, lay.engram_offset : lay.engram_offset + lay.engram_history * 4].view(torch.int32)

    # ---- the DSpark draft's context K=V --------------------------------------------------------

    def draft_ring(self, stage: int) -> torch.Tensor:
        """fp32 [num_state_slots, W, head_dim]: draft stage ``stage``'s context K=V of position p at column p mod W."""
        lay = self.layout
        if not 0 <= stage < lay.draft_stages:
            raise ValueError(f"draft stage {stage} is not in this cache's {lay.draft_stages} draft rings")
        size = lay.draft_window * lay.head_dim * 4
        return self._slot_view(lay.draft_offset + stage * size, lay.draft_window, lay.head_dim * 4).view(torch.float32)

    def write_draft(self, slot: int, first_position: int, kv: list[torch.Tensor]) -> None:
        """The draft's context K=V of positions first_position … + N − 1 of the request in ``slot``: one
        [N, head_dim] per stage. Only the last W of them can ever be read, so only those are written."""
        w = self.layout.draft_window
        num = kv[0].shape[0]
        keep = min(num, w)
        columns = torch.arange(first_position + num - keep, first_position + num, device=self.slots.device) % w
        for stage, values in enumerate(kv):
            self.draft_ring(stage)[slot, columns] = values[num - keep :].float()

    def read_draft(self, slots: torch.Tensor, next_positions: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The draft's window for blocks anchored at ``next_positions`` (int64 [B]) of the requests in ``slots``
        (int64 [B]): (per stage fp32 [B, W, head_dim], positions int64 [B, W] oldest first, −1 before position 0;
        the slots of those columns hold stale values that the draft's attention masks)."""
        w = self.layout.draft_window
        positions = next_positions.unsqueeze(1) - w + torch.arange(w, device=slots.device)  # [B, W]
        columns = positions % w
        kv = [self.draft_ring(stage)[slots.unsqueeze(1), columns] for stage in range(self.layout.draft_stages)]
        return kv, torch.where(positions >= 0, positions, torch.full_like(positions, -1))

    # ---- fork ---------------------------------------------------------------------------------

    def copy(self, block_copies: list[tuple[int, int]], state_copies: list[tuple[int, int]]) -> None:
        """(source, destination) pairs, done before the step's forward."""
        for src, dst in block_copies:
            self.blocks[dst] = self.blocks[src]
        for src, dst in state_copies:
            self.slots[dst] = self.slots[src]
