"""The cache pools: byte counts of the released layout, packed round trips, non-overlapping regions."""

import logging

import pytest
import torch

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.quant import fake_quant_compressed_kv, fake_quant_fp8_e4m3, fake_quant_indexer
from services.worker.state.cache_engine import CacheEngine, CacheLayout, cache_bytes, ring_size
from tests.scheduler_rs.configs import scheduler_config

FLASH = ModelConfig()


def test_flash_bytes_per_block_and_slot():
    per_block, per_slot = cache_bytes(FLASH, 128)
    # Entries: 256 B FP4 + 32 e4m3 scales; index keys: 64 B FP4 + 4 e8m0 scales; 356 B per entry.
    # Three ratio-2 sources (64 entries per block) and one ratio-1 source (128).
    assert per_block == 3 * 64 * 356 + 128 * 356 == 113_920
    assert per_block / 128 == 890
    rings = 40 * 134 * 528  # every layer's FP8 ring: 512 e4m3 + 16 e8m0 per position
    partial = 3 * (2 - 1 + 6) * 2 * 512 * 4  # ratio-2 sources: (value, gate) fp32 rows, 1 + 6 backtracking
    engram = (4 - 1 + 6) * 4  # compressed ids, int32
    assert per_slot == rings + partial + engram == 2_916_132


def test_tiny_bytes_and_the_ring_matches_the_scheduler():
    assert ring_size(TINY) == scheduler_config(window_size=TINY.sliding_window).ring_size == 14
    assert ring_size(FLASH) == scheduler_config(window_size=128).ring_size == 134
    assert ring_size(FLASH, nextn=5) == scheduler_config(window_size=128, nextn=5).ring_size
    per_block, per_slot = cache_bytes(TINY, 16)
    # head_dim 64: 32 + 4 = 36 B; index_head_dim 32: 16 + 1 = 17 B; ratio-2 source 8 per block, ratio-1 16.
    assert per_block == 8 * 53 + 16 * 53
    assert per_slot == 8 * 14 * 66 + (1 + 6) * 2 * 64 * 4 + (2 + 6) * 4


def test_block_size_must_divide_by_every_ratio():
    with pytest.raises(ValueError, match="multiple of layer 2's ratio 2"):
        CacheLayout.build(TINY, 15, 14)


def test_start_up_logs_the_byte_counts(caplog):
    with caplog.at_level(logging.INFO, logger="services.worker.state.cache_engine"):
        CacheEngine(TINY, 16, num_blocks=4, num_state_slots=3, ring=14)
    assert "1,272 bytes per 16-token block" in caplog.text and "11,008 bytes per state slot" in caplog.text


def test_round_trips_equal_the_model_rounding_and_regions_do_not_overlap():
    g = torch.Generator().manual_seed(0)
    cache = CacheEngine(TINY, 16, num_blocks=5, num_state_slots=4, ring=14)
    hd, di = TINY.head_dim, TINY.index_head_dim
    written = {}
    # Fill every region of block 3 and slot 2 through the typed writers.
    for layer in TINY.kv_source_layer_ids:
        epb = cache.layout.source(layer).entries_per_block
        kv, keys = torch.randn(epb, hd, generator=g) * 3, torch.randn(epb, di, generator=g)
        cache.write_entries(layer, 3 * epb + torch.arange(epb), kv, keys)
        written[layer] = (kv, keys)
    windows = {}
    for layer in range(TINY.num_hidden_layers):
        k = torch.randn(14, hd, generator=g) * 5
        cache.write_window(layer, torch.full((14,), 2), torch.arange(14), k)
        windows[layer] = k
    u, gate = torch.randn(7, hd, generator=g), torch.randn(7, hd, generator=g)
    cache.write_partial(2, torch.full((7,), 2), torch.arange(10, 17), u, gate)
    cache.engram_history()[2] = torch.arange(8, dtype=torch.int32) + 100
    # Read everything back: equal to the model's fake quantisation, so no write clobbered another.
    table = torch.tensor([[0, 0, 0, 3]])
    for layer, (kv, keys) in written.items():
        epb = cache.layout.source(layer).entries_per_block
        got_kv, got_keys = cache.read_entries(layer, table, 4 * epb)
        assert torch.equal(got_kv[0, 3 * epb :], fake_quant_compressed_kv(kv))
        assert torch.equal(got_keys[0, 3 * epb :], fake_quant_indexer(keys))
        assert not got_kv[0, : 3 * epb].any()  # block 0 stays null
    for layer, k in windows.items():
        assert torch.equal(cache.read_window(layer, torch.tensor([2]))[0], fake_quant_fp8_e4m3(k))
    partial = cache.partial(2)[2]  # row = position mod 7
    order = torch.arange(10, 17) % 7
    assert torch.equal(partial[order, 0], u) and torch.equal(partial[order, 1], gate)
    assert cache.engram_history()[2].tolist() == list(range(100, 108))
    assert not cache.slots[[0, 1, 3]].any() and not cache.blocks[[0, 1, 2, 4]].any()


def test_fork_copies_blocks_and_slots():
    cache = CacheEngine(TINY, 16, num_blocks=4, num_state_slots=3, ring=14)
    cache.blocks[1] = 7
    cache.slots[1] = 9
    cache.copy([(1, 3)], [(1, 2)])
    assert torch.equal(cache.blocks[3], cache.blocks[1]) and torch.equal(cache.slots[2], cache.slots[1])


def test_the_draft_rings_live_in_the_state_slots_only_with_speculation():
    """With drafts, a state slot also holds each DSpark stage's context K=V ring (W fp32 rows): the slot
    pool, and so the scheduler's slot accounting, covers the draft's state. Without, nothing changes."""
    stages, w, hd = TINY.num_nextn_predict_layers, TINY.sliding_window, TINY.head_dim
    assert stages > 0
    _, plain = cache_bytes(TINY, 16)
    per_block, with_draft = cache_bytes(TINY, 16, nextn=3)
    assert per_block == cache_bytes(TINY, 16)[0]
    assert with_draft == plain + stages * w * hd * 4
    with pytest.raises(ValueError, match="draft stage 0 is not in this cache's 0 draft rings"):
        CacheEngine(TINY, 16, num_blocks=4, num_state_slots=3, ring=14).draft_ring(0)


def test_draft_ring_round_trip_window_and_isolation():
    g = torch.Generator().manual_seed(1)
    stages, w, hd = TINY.num_nextn_predict_layers, TINY.sliding_window, TINY.head_dim
    cache = CacheEngine(TINY, 16, num_blocks=4, num_state_slots=4, ring=14, draft=True)
    other = cache.slots[3].clone()
    # Slot 1: positions 0 … w + 2 in two writes (the second wraps the ring); slot 2: positions 0 … 2.
    values = [torch.randn(w + 3, hd, generator=g) for _ in range(stages)]
    cache.write_draft(1, 0, [v[:5] for v in values])
    cache.write_draft(1, 5, [v[5:] for v in values])
    short = [torch.randn(3, hd, generator=g) for _ in range(stages)]
    cache.write_draft(2, 0, short)
    kv, positions = cache.read_draft(torch.tensor([1, 2]), torch.tensor([w + 3, 3]))
    assert positions[0].tolist() == list(range(3, w + 3))
    assert positions[1].tolist() == [-1] * (w - 3) + [0, 1, 2]
    for k in range(stages):
        assert torch.equal(kv[k][0], values[k][3:])  # the last w positions, oldest first
        assert torch.equal(kv[k][1][w - 3 :], short[k])
    assert torch.equal(cache.slots[3], other)  # no other slot was touched
    # Nothing else in a slot overlaps the draft's rings.
    cache.slots[1, : cache.layout.draft_offset] = 5
    cache.write_draft(1, w + 3, [torch.full((w, hd), 7.0) for _ in range(stages)])
    assert bool((cache.slots[1, : cache.layout.draft_offset] == 5).all())
    assert cache.layout.draft_offset + stages * w * hd * 4 == cache.layout.bytes_per_slot
    # A fork's state copy carries the draft's rings.
    cache.copy([], [(1, 3)])
    assert torch.equal(cache.draft_ring(0)[3], cache.draft_ring(0)[1])
