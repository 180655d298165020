import dataclasses

import torch

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.engram import DEAD, EngramHasher, engram_multipliers, engram_primes
from model.deepseek_v41.presets import ENGRAM_S1_ROWS, TINY, V41_S1


def test_flash_multipliers_are_the_released_ones():
    """Spec §3.8 lists the Flash multipliers of layers 1 and 14."""
    assert engram_multipliers(1, 99092, 4) == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert engram_multipliers(14, 99092, 4) == [67716810739261, 51510806800915, 30921347202721, 82619226485591]


def test_flash_table_rows_are_the_prime_sums():
    primes = engram_primes(ModelConfig())
    assert primes[0][:2] == [16000057, 16000079]
    assert [sum(p) for p in primes] == [384006168, 384016682]
    assert max(primes[0]) < min(primes[1])


def test_tiny_and_s1_tables_are_exactly_their_primes():
    assert [sum(p) for p in engram_primes(TINY)] == list(TINY.engram_num_embeddings)
    assert engram_primes(TINY) == [[53, 59, 61, 67], [71, 73, 79, 83]]
    assert [sum(p) for p in engram_primes(V41_S1)] == list(ENGRAM_S1_ROWS)


def _hasher() -> EngramHasher:
    cfg = dataclasses.replace(
        TINY, vocab_size=16, engram_compressed_vocab_size=8, num_nextn_predict_layers=0, vision=None
    )
    token_map = torch.arange(16) % 8  # ids t and t+8 share a compressed id
    return EngramHasher(cfg, token_map, 8)


def test_history_pads_before_the_start_and_through_dead_tokens():
    h = _hasher()
    pad = h.pad
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    hist = h.history(ids)
    assert hist[0, 0].tolist() == [3, pad, pad]
    assert hist[0, 4].tolist() == [7, 6, 5]
    live = torch.tensor([[True, True, False, True, True]])
    hist = h.history(ids, live)
    assert hist[0, 3].tolist() == [6, pad, pad]  # the dead token and everything older are pad
    assert hist[0, 4].tolist() == [7, 6, pad]


def test_the_image_placeholder_is_dead_and_a_carried_dead_slot_blocks_older_ones():
    """With a vision tower the placeholder's compressed id is DEAD, so a cached engine's carried history
    (slots p, p−1, …; a DEAD slot inside) hashes as the full forward's history does."""
    cfg = dataclasses.replace(
        TINY,
        vocab_size=16,
        engram_compressed_vocab_size=8,
        num_nextn_predict_layers=0,
        vision=dataclasses.replace(TINY.vision, image_token_id=12),
    )
    h = EngramHasher(cfg, torch.arange(16) % 8, 8)
    assert int(h.token_map[12]) == DEAD and int(h.token_map[4]) == 4
    ids = torch.tensor([[3, 12, 12, 5, 6]])
    full = h.history(ids)
    assert full[0, 3].tolist() == [5, h.pad, h.pad] and full[0, 4].tolist() == [6, 5, h.pad]
    carried = torch.tensor([[[5, DEAD, DEAD], [6, 5, DEAD], [DEAD, 3, 7]]])  # as a cached engine reads them
    expected = torch.tensor([[[5, h.pad, h.pad], [6, 5, h.pad], [h.pad, h.pad, h.pad]]])
    assert torch.equal(h.rows(carried), h.rows(expected))
    assert torch.equal(h.rows(full), h.rows(full.clone()))


def test_rows_depend_on_compressed_ids_and_stay_in_their_bucket():
    h = _hasher()
    a = h.rows(h.history(torch.tensor([[1, 2, 3]])))
    b = h.rows(h.history(torch.tensor([[9, 10, 11]])))  # same compressed ids
    assert torch.equal(a, b)
    offsets, primes = h.offsets, h.primes
    assert bool(((a >= offsets) & (a < offsets + primes)).all())
