"""Philox4x32-10 and the draw layout: published known answers, an independent pure-Python reference."""

import random

import pytest
import torch

from kernels.philox import (
    DrawCase,
    bits_of_uniform,
    draw_bits,
    draw_bits_per_token,
    philox4x32,
    stream_of,
    uniform_of_bits,
)

# Random123's kat_vectors, "philox4x32 10" lines: counter[4], key[2] → output[4].
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def reference_philox(counter, key, rounds=10):
    """Philox4x32 from Salmon et al. (SC'11) with Python ints: written apart from the torch version."""
    m0, m1, w0, w1 = 0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85
    x = list(counter)
    k = list(key)
    for r in range(rounds):
        p0 = m0 * x[0]
        p1 = m1 * x[2]
        x = [
            ((p1 >> 32) ^ x[1] ^ k[0]) & 0xFFFFFFFF,
            p1 & 0xFFFFFFFF,
            ((p0 >> 32) ^ x[3] ^ k[1]) & 0xFFFFFFFF,
            p0 & 0xFFFFFFFF,
        ]
        k = [(k[0] + w0) & 0xFFFFFFFF, (k[1] + w1) & 0xFFFFFFFF]
    return tuple(x)


def reference_draw(seed, position, case):
    seed %= 1 << 64
    stream = 3 * position + case
    out = reference_philox((stream & 0xFFFFFFFF, stream >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))
    return out[0] >> 1


@pytest.mark.parametrize("counter,key,expected", KNOWN_ANSWERS)
def test_known_answers(counter, key, expected):
    assert reference_philox(counter, key) == expected
    out = philox4x32(torch.tensor(counter), torch.tensor(key))
    assert tuple(out.tolist()) == expected


def test_torch_philox_equals_the_reference_on_random_words():
    rng = random.Random(7)
    edge = [0, 1, 0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]
    words = [[rng.choice(edge) if rng.random() < 0.3 else rng.getrandbits(32) for _ in range(6)] for _ in range(300)]
    table = torch.tensor(words, dtype=torch.int64)
    out = philox4x32(table[:, :4], table[:, 4:])
    for w, got in zip(words, out.tolist()):
        assert tuple(got) == reference_philox(w[:4], w[4:])


def test_philox_rejects_non_int64_words():
    with pytest.raises(TypeError):
        philox4x32(torch.zeros(4, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))


def test_draw_layout_key_is_the_seed_and_counter_is_the_stream():
    rng = random.Random(11)
    # Large positions put bits in the counter's second word; large seeds in the key's second word.
    seeds = [0, 1, 2**32, 2**63 - 1, 2**64 - 1] + [rng.getrandbits(64) for _ in range(45)]
    positions = [0, 5, 2**31, 2**40, 16_389] + [rng.getrandbits(rng.choice((4, 20, 50))) for _ in range(45)]
    for case in DrawCase:
        got = draw_bits(seeds, positions, case).tolist()
        assert got == [reference_draw(s, p, int(case)) for s, p in zip(seeds, positions)]


def test_draws_are_31_bit_and_look_uniform():
    bits = draw_bits([3] * 4096, list(range(4096)))
    assert bits.dtype == torch.int64
    assert int(bits.min()) >= 0 and int(bits.max()) < 2**31
    u = uniform_of_bits(bits)
    # Mean of 4096 uniforms: sd 0.0045; the top bit (u >= 0.5) is a fair coin: sd 32.
    assert abs(float(u.mean()) - 0.5) < 0.025
    assert abs(int((u >= 0.5).sum()) - 2048) < 200
    assert len(set(bits.tolist())) == 4096


def test_a_draw_depends_only_on_seed_position_and_case():
    seeds = [5, 9, 5, 2**64 - 1, 123456789]
    positions = [0, 16_389, 1, 7, 7]
    together = draw_bits(seeds, positions).tolist()
    alone = [draw_bits([s], [p]).tolist()[0] for s, p in zip(seeds, positions)]
    assert together == alone
    assert draw_bits(seeds[::-1], positions[::-1]).tolist() == together[::-1]
    # Cases are separate streams: 3 × position + case never collides across positions.
    by_case = [draw_bits([5], [16_389], c).item() for c in DrawCase]
    assert len(set(by_case)) == 3
    assert draw_bits([5], [16_390], DrawCase.SAMPLE).item() != by_case[0]
    assert draw_bits([5], [16_389], DrawCase.ACCEPT).item() == reference_draw(5, 16_389, 2)


def test_seed_is_taken_mod_2_64():
    assert draw_bits([-1], [4]).item() == draw_bits([2**64 - 1], [4]).item()
    assert draw_bits([2**64 + 3], [4]).item() == draw_bits([3], [4]).item()
    assert draw_bits([1], [4]).item() != draw_bits([2], [4]).item()


def test_stream_of_checks_position_and_case():
    assert stream_of(16_389, 0) == 49_167  # the walkthrough's r1
    assert stream_of(16_389, DrawCase.ACCEPT) == 49_169
    for position, case in ((-1, 0), (0, 3), (0, -1), (2**64, 0)):
        with pytest.raises(ValueError):
            stream_of(position, case)
    with pytest.raises(ValueError):
        draw_bits([1, 2], [0])


def test_uniform_and_bits_convert_exactly():
    assert bits_of_uniform(0.0) == 0
    assert bits_of_uniform(0.5) == 2**30
    assert bits_of_uniform(0.93) == int(0.93 * 2**31)  # floor(1,997,159,792.64)
    assert bits_of_uniform(0.93) == 1_997_159_792
    assert bits_of_uniform(1 - 2**-31) == 2**31 - 1
    assert float(uniform_of_bits(torch.tensor([2**30]))) == 0.5
    for bad in (1.0, -1e-9, float("nan")):
        with pytest.raises(ValueError):
            bits_of_uniform(bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_draws_equal_cpu_draws():
    rng = random.Random(3)
    seeds = [rng.getrandbits(64) for _ in range(1000)]
    positions = [rng.getrandbits(30) for _ in range(1000)]
    for case in DrawCase:
        assert draw_bits(seeds, positions, case, "cuda").tolist() == draw_bits(seeds, positions, case).tolist()


def test_per_token_draws_have_their_own_counter_word_and_follow_the_layout():
    seeds, positions = [5, -1, 2**64 - 1, 2**63 + 7], [16_389, 3, 3, 0]
    bits = draw_bits_per_token(seeds, positions, 7)
    for i, (seed, position) in enumerate(zip(seeds, positions)):
        seed %= 1 << 64
        stream = 3 * position
        for v in range(7):
            out = reference_philox((stream & 0xFFFFFFFF, stream >> 32, v, 1), (seed & 0xFFFFFFFF, seed >> 32))
            assert int(bits[i, v]) == out[0] >> 1
    assert torch.equal(bits[1], bits[2])  # -1 and 2**64 - 1 are the same seed
    # Word 3 = 1 keeps them apart from the sampler's draws (word 3 = 0), even for token 0.
    assert int(bits[0, 0]) != reference_draw(5, 16_389, 0)
