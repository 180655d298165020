"""The sampler: the walkthrough's worked examples, each processing step, integer mass, errors, determinism."""

import dataclasses
import math
import random

import pytest
import torch

from kernels.philox import DrawCase, bits_of_uniform, draw_bits
from services.worker.sampling.sampler import (
    Sampler,
    SamplingRow,
    accept_draft,
    integer_masses,
    sample_from_bits,
    sample_from_uniform,
)

VOCAB = 129_280  # DeepSeek's real vocabulary
SAMPLER = Sampler()


def row(**changes):
    fields = dict(
        temperature=1.0, top_k=-1, top_p=1.0, seed=0, position=0, forced_top_k=None, banned_token_ids=(), num_logprobs=0
    )
    fields.update(changes)
    return SamplingRow(**fields)


def processed(logits, **changes):
    """The processed distribution of one row, in id order."""
    return SAMPLER.process(torch.tensor([logits]), [row(**changes)]).probs[0]


def kept(logits, **changes):
    return [i for i, p in enumerate(processed(logits, **changes).tolist()) if p > 0]


# --- the walkthrough's worked examples --------------------------------------------------------------

# A probability or log-probability of a softmax over a handful of fp32 logits against its exact value: each
# of the few roundings moves it by ≤ u32 × |logit| (logits ≤ 4 here, so ≤ 2.4e-7 each).
FP32_SOFTMAX_ABS = 1e-6


def printed(values: list[float], decimals: int):
    """A worked example's values as printed to ``decimals`` places: exact to half a unit in the last place,
    plus FP32_SOFTMAX_ABS for the fp32 softmax."""
    return pytest.approx(values, abs=0.5 * 10.0**-decimals + FP32_SOFTMAX_ABS)


def test_walkthrough_picking_a_token():
    # A, B, C, D = 2.0, 1.0, 0.5, -1.0; T 0.5 → 4, 2, 1, -2; softmax 0.842, 0.114, 0.042, 0.002.
    logits = [2.0, 1.0, 0.5, -1.0]
    full = processed(logits, temperature=0.5)
    assert full.tolist() == printed([0.842, 0.114, 0.042, 0.002], 3)
    # Top-p 0.9: A alone 0.842 is not enough, A + B = 0.956 is; renormalised 0.881 / 0.119.
    probs = processed(logits, temperature=0.5, top_p=0.9)
    assert probs.tolist() == printed([0.881, 0.119, 0.0, 0.0], 3)
    # A covers [0, 0.881), B [0.881, 1): the draw 0.93 picks B, and 0.87 would pick A.
    assert sample_from_uniform(probs.unsqueeze(0), 0.93).tolist() == [1]
    assert sample_from_uniform(probs.unsqueeze(0), 0.87).tolist() == [0]


def test_walkthrough_five_token_exercise():
    # Logits 3, 2, 2, 0, -1 at T 1: e^x = 20.086, 7.389, 7.389, 1.000, 0.368 (total 36.231), so
    # p = 0.5544, 0.2039, 0.2039, 0.0276, 0.0102. Top-p 0.8 by rank (ties to the lower id):
    # 0.5544 < 0.8, 0.5544 + 0.2039 = 0.7583 < 0.8, + 0.2039 = 0.9622 ≥ 0.8 → keep tokens 0, 1, 2.
    # Renormalised by 0.9622: 0.5761, 0.2119, 0.2119. Token 0 covers [0, 0.5761): 0.55 picks token 0.
    logits = [3.0, 2.0, 2.0, 0.0, -1.0]
    assert processed(logits).tolist() == printed([0.5544, 0.2039, 0.2039, 0.0276, 0.0102], 4)
    probs = processed(logits, top_p=0.8)
    assert probs.tolist() == printed([0.5761, 0.2119, 0.2119, 0.0, 0.0], 4)
    assert sample_from_uniform(probs.unsqueeze(0), 0.55).tolist() == [0]
    # The draft: token 2 with draft probability 0.5. Accept iff coin < min(1, 0.2119 / 0.5) = 0.4239:
    # the coin 0.75 rejects it (0.42 would have accepted it).
    target = probs.log()[2:3]
    draft = torch.tensor([math.log(0.5)])
    assert accept_draft(target, draft, torch.tensor([bits_of_uniform(0.75)])).tolist() == [False]
    assert accept_draft(target, draft, torch.tensor([bits_of_uniform(0.42)])).tolist() == [True]


def test_accept_draft_never_passes_a_token_outside_the_kept_set():
    target = torch.tensor([-math.inf, 0.0, math.log(0.3)])
    draft = torch.tensor([math.log(0.9), math.log(0.2), math.log(0.6)])
    bits = torch.tensor([0, 2**31 - 1, bits_of_uniform(0.42)])
    # t - d = -inf; t > d always accepts; t/d = 0.5 and the walkthrough's coin 0.42 accepts.
    assert accept_draft(target, draft, bits).tolist() == [False, True, True]


# --- each processing step ----------------------------------------------------------------------------


def test_temperature_is_applied_before_top_p():
    logits = [2.0, 1.0, 0.5, -1.0]
    assert kept(logits, temperature=0.5, top_p=0.9) == [0, 1]
    # At T 1: 0.609, 0.224, 0.136, 0.030 → 0.609 + 0.224 = 0.833 < 0.9, so C is kept too.
    assert kept(logits, temperature=1.0, top_p=0.9) == [0, 1, 2]
    assert kept(logits, temperature=2.0) == [0, 1, 2, 3]


def test_top_k_renormalises_before_top_p():
    logits = [2.0, 1.0, 0.5, -1.0]
    # Top-k 2 leaves A, B at e/(e + 1) = 0.731, 0.269; top-p 0.7 then keeps A alone.
    # On the full distribution A is only 0.609 and top-p 0.7 would keep A and B.
    assert kept(logits, top_k=2) == [0, 1]
    assert kept(logits, top_p=0.7) == [0, 1]
    assert kept(logits, top_k=2, top_p=0.7) == [0]
    assert processed(logits, top_k=2).tolist() == printed([0.7311, 0.2689, 0, 0], 4)


def test_forced_top_k_comes_first_and_combines_with_top_k():
    logits = [2.0, 1.0, 0.5, -1.0]
    assert kept(logits, forced_top_k=2, top_p=0.7) == [0]
    assert kept(logits, forced_top_k=3) == [0, 1, 2]
    assert kept(logits, forced_top_k=2, top_k=3) == [0, 1]
    assert kept(logits, forced_top_k=3, top_k=1) == [0]
    assert kept(logits, forced_top_k=10, top_k=10) == [0, 1, 2, 3]


def test_rank_ties_go_to_the_lower_id():
    logits = [1.0, 2.0, 2.0, 0.0, 2.0]
    assert kept(logits, top_k=1) == [1]
    assert kept(logits, top_k=2) == [1, 2]
    assert kept(logits, top_p=0.1) == [1]
    assert kept(logits, forced_top_k=2) == [1, 2]
    out = SAMPLER(torch.tensor([logits]), [row(num_logprobs=5)])
    assert out.top_token_ids.tolist() == [[1, 2, 4, 0, 3]]


def test_rank_ties_over_the_real_vocabulary():
    logits = torch.zeros(1, VOCAB)
    logits[0, VOCAB - 3 :] = 1.0
    out = SAMPLER(logits, [row(top_k=8, num_logprobs=8)])
    assert out.top_token_ids.tolist() == [[VOCAB - 3, VOCAB - 2, VOCAB - 1, 0, 1, 2, 3, 4]]
    probs = SAMPLER.process(logits, [row(top_k=8)]).probs[0]
    assert (probs > 0).nonzero().flatten().tolist() == [0, 1, 2, 3, 4, VOCAB - 3, VOCAB - 2, VOCAB - 1]


def test_top_p_one_and_top_k_off_keep_everything():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1)).tolist()[0]
    for top_k in (-1, 0, 50, 1000):
        assert len(kept(logits, top_k=top_k)) == 50
    expected = torch.softmax(torch.tensor(logits), -1)
    assert torch.allclose(processed(logits), expected, atol=1e-7)


def test_bans_remove_tokens_before_everything_else():
    logits = [2.0, 1.0, 0.5, -1.0]
    assert kept(logits, banned_token_ids=(0,), top_k=2) == [1, 2]
    probs = processed(logits, banned_token_ids=(0, 2))
    exact = [0, math.e**2 / (math.e**2 + 1), 0, 1 / (math.e**2 + 1)]
    assert probs.tolist() == pytest.approx(exact, abs=FP32_SOFTMAX_ABS)
    seeds = range(200)
    out = SAMPLER(torch.tensor([[5.0, 4.0, 0.0]] * 200), [row(seed=s, banned_token_ids=(0,)) for s in seeds])
    assert set(out.token_ids.tolist()) == {1, 2}
    assert not out.errors.any()


def test_banned_id_outside_the_vocabulary_is_rejected():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SAMPLER(torch.zeros(1, 4), [row(banned_token_ids=(4,))])


def test_greedy_takes_the_argmax_with_ties_to_the_lowest_id_for_any_seed():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0]] * 4)
    rows = [row(temperature=0.0, seed=s, position=s * 7) for s in range(4)]
    assert SAMPLER(logits, rows).token_ids.tolist() == [1, 1, 1, 1]
    rows = [
        row(temperature=0.0, banned_token_ids=(1,)),
        row(temperature=0.0, banned_token_ids=(1, 2)),
        row(temperature=0.0, top_p=0.01),
        row(temperature=0.0, top_k=1),
    ]
    assert SAMPLER(logits, rows).token_ids.tolist() == [2, 3, 1, 1]


def test_greedy_logprobs_are_the_processed_distribution_at_temperature_1():
    logits = torch.tensor([[1.0, 3.0, 2.5, 2.0]])
    raw = torch.log_softmax(logits[0], -1)
    out = SAMPLER(logits, [row(temperature=0.0, num_logprobs=2)])
    assert out.logprobs.item() == pytest.approx(raw[1].item(), abs=FP32_SOFTMAX_ABS)
    assert out.top_logprobs[0].tolist() == pytest.approx(raw[[1, 2]].tolist(), abs=FP32_SOFTMAX_ABS)
    # With top-k 2 the distribution is renormalised over tokens 1 and 2 (at T 1, not T → 0).
    out = SAMPLER(logits, [row(temperature=0.0, top_k=2)])
    assert out.logprobs.item() == pytest.approx(-math.log(1 + math.exp(-0.5)), abs=FP32_SOFTMAX_ABS)


def test_logprobs_are_of_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 64)
    rows = [row(temperature=0.5, top_p=0.9, seed=s, num_logprobs=3) for s in range(64)]
    out = SAMPLER(logits, rows)
    expected = {0: -math.log1p(math.exp(-2.0)), 1: -math.log1p(math.exp(2.0))}  # T 0.5: logits 4, 2 kept
    assert set(out.token_ids.tolist()) == {0, 1}
    for token, logprob in zip(out.token_ids.tolist(), out.logprobs.tolist()):
        assert logprob == pytest.approx(expected[token], abs=FP32_SOFTMAX_ABS)
    assert out.top_token_ids.tolist() == [[0, 1, 2]] * 64
    top = out.top_logprobs[0].tolist()
    assert top[:2] == pytest.approx([expected[0], expected[1]], abs=FP32_SOFTMAX_ABS) and top[2] == -math.inf


def test_top_n_width_is_the_largest_request_and_extra_columns_are_next_ranks():
    logits = torch.tensor([[0.0, 4.0, 1.0, 3.0, 2.0], [5.0, 1.0, 4.0, 2.0, 3.0]])
    out = SAMPLER(logits, [row(num_logprobs=1), row(num_logprobs=3)])
    assert out.top_token_ids.tolist() == [[1, 3, 4], [0, 2, 4]]
    assert out.top_logprobs.shape == (2, 3) and out.top_logprobs.dtype == torch.float32
    assert torch.allclose(out.top_logprobs, torch.log_softmax(logits, -1).gather(1, out.top_token_ids))
    assert SAMPLER(logits, [row(), row()]).top_token_ids.shape == (2, 0)
    assert SAMPLER(logits, [row(num_logprobs=9), row()]).top_token_ids.shape == (2, 5)


# --- integer mass and the draw ------------------------------------------------------------------------


def reference_pick(probs, bits):
    """Pure-Python integer draw: masses floor(p · 2³¹), threshold floor(bits · total / 2³¹)."""
    masses = [math.floor(p * 2**31) for p in probs]
    threshold = bits * sum(masses) // 2**31
    running = 0
    for token, mass in enumerate(masses):
        running += mass
        if running > threshold:
            return token
    raise AssertionError("threshold beyond the total")


def test_draw_matches_the_integer_reference():
    gen = torch.Generator().manual_seed(5)
    probs = torch.softmax(torch.randn(300, 37, generator=gen) * 2, -1)
    bits = torch.randint(0, 2**31, (300,), generator=gen)
    got = sample_from_bits(probs, bits).tolist()
    assert got == [reference_pick(p, b) for p, b in zip(probs.double().tolist(), bits.tolist())]


def test_masses_are_floor_p_times_2_31():
    probs = torch.tensor([0.5, 0.25, 2**-31, 2**-32, 1.0, 0.3], dtype=torch.float32)
    assert integer_masses(probs).tolist() == [2**30, 2**29, 1, 0, 2**31, math.floor(float(probs[5]) * 2**31)]


def test_draw_uses_the_actual_total_so_the_last_token_is_reachable():
    probs = torch.tensor([[0.3, 0.3]])  # sums to 0.6: the draw scales to the total, not to 2³¹
    assert sample_from_uniform(probs, 0.49).tolist() == [0]
    assert sample_from_uniform(probs, 0.51).tolist() == [1]
    probs = torch.tensor([[1 - 2**-20, 2**-20]])
    assert sample_from_bits(probs, torch.tensor([2**31 - 1])).tolist() == [1]
    assert sample_from_bits(probs, torch.tensor([0])).tolist() == [0]


def test_a_threshold_on_a_boundary_belongs_to_the_next_token():
    # A covers [0, 2³⁰) and B [2³⁰, 2³¹) in integer mass: u = 0.5 is B's first unit, one unit less is A's last.
    probs = torch.tensor([[0.5, 0.5]] * 2)
    assert sample_from_bits(probs, torch.tensor([2**30, 2**30 - 1])).tolist() == [1, 0]
    assert sample_from_uniform(probs, [0.5, 0.0]).tolist() == [1, 0]


def test_zero_mass_tokens_are_never_drawn():
    probs = torch.tensor([[0.5, 0.0, 2**-33, 0.5, 0.0]] * 1001)
    bits = torch.tensor([i * (2**31 - 1) // 1000 for i in range(1001)])
    assert set(sample_from_bits(probs, bits).tolist()) == {0, 3}


def test_sample_from_bits_rejects_bad_input():
    for probs, bits in (
        (torch.zeros(1, 3), [0]),
        (torch.tensor([[0.5, float("nan")]]), [0]),
        (torch.tensor([[1.0, -0.1]]), [0]),
        (torch.tensor([[1.0]]), [2**31]),
        (torch.tensor([[3.0]]), [0]),
    ):
        with pytest.raises(ValueError):
            sample_from_bits(probs, torch.tensor(bits))


def test_sampled_token_is_the_philox_draw_of_seed_and_position():
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(2))
    rows = [row(seed=1000 + i, position=16_389 + i, top_p=0.95, temperature=0.8) for i in range(8)]
    out = SAMPLER(logits, rows)
    probs = SAMPLER.process(logits, rows).probs
    bits = draw_bits([r.seed for r in rows], [r.position for r in rows], DrawCase.SAMPLE)
    assert out.token_ids.tolist() == sample_from_bits(probs, bits).tolist()
    assert out.token_ids.tolist() == [reference_pick(p, b) for p, b in zip(probs.double().tolist(), bits.tolist())]


def test_frequencies_follow_the_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 8000)
    rows = [row(seed=s, position=3) for s in range(8000)]
    counts = torch.bincount(SAMPLER(logits, rows).token_ids, minlength=4).double() / 8000
    expected = torch.softmax(logits[0].double(), -1)
    # Binomial sd is at most 0.0056 at n = 8000; 0.025 is over 4 sd.
    assert torch.allclose(counts, expected, atol=0.025)


# --- errors -------------------------------------------------------------------------------------------


def test_fully_masked_and_nan_rows_are_errors_and_the_rest_carry_on():
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 6, generator=gen)
    logits[2, 3] = float("nan")
    logits[3, 1] = float("inf")
    rows = [
        row(seed=1, num_logprobs=2),
        row(seed=2, banned_token_ids=tuple(range(6)), num_logprobs=2),
        row(seed=3, num_logprobs=2),
        row(seed=4, temperature=0.0),
    ]
    out = SAMPLER(logits, rows)
    assert out.errors.tolist() == [False, True, True, True]
    assert out.token_ids.tolist()[1:] == [0, 0, 0]
    assert out.logprobs.tolist()[1:] == [-math.inf] * 3
    assert (out.top_logprobs[1:] == -math.inf).all()
    alone = SAMPLER(logits[:1], rows[:1])
    assert out.token_ids[0] == alone.token_ids[0] and out.logprobs[0] == alone.logprobs[0]
    all_inf = SAMPLER(torch.full((1, 5), -math.inf), [row()])
    assert all_inf.errors.tolist() == [True] and all_inf.token_ids.tolist() == [0]
    # A NaN on a banned token is gone with the token: not an error.
    assert not SAMPLER(logits[2:3], [row(banned_token_ids=(3,))]).errors.any()


# --- determinism ---------------------------------------------------------------------------------------


def mixed_rows():
    rng = random.Random(4)
    rows = []
    for i in range(16):
        rows.append(
            row(
                temperature=[0.0, 0.3, 0.7, 1.0, 1.5][i % 5],
                top_k=[-1, 0, 20, 1000][i % 4],
                top_p=[1.0, 0.9, 0.5][i % 3],
                seed=rng.getrandbits(64),
                position=rng.randrange(10, 5000),
                forced_top_k=[None, 4096, None, 64][i % 4],
                banned_token_ids=tuple(rng.sample(range(VOCAB), i % 3)) + ((1,) if i % 5 == 1 else ()),
                num_logprobs=[0, 5, 20, 1][i % 4],
            )
        )
    return rows


def test_a_row_is_the_same_alone_and_in_a_batch_of_16_in_any_order():
    gen = torch.Generator().manual_seed(0)
    # Sharp logits like a real model's: most rows sample from a handful of tokens.
    logits = torch.randn(16, VOCAB, generator=gen) * 4
    rows = mixed_rows()
    alone = [SAMPLER(logits[i : i + 1], rows[i : i + 1]) for i in range(16)]
    rng = random.Random(1)
    for _ in range(2):
        perm = list(range(16))
        rng.shuffle(perm)
        out = SAMPLER(logits[perm], [rows[i] for i in perm])
        for j, i in enumerate(perm):
            n = rows[i].num_logprobs
            assert out.token_ids[j].item() == alone[i].token_ids.item()
            assert out.logprobs[j].item() == alone[i].logprobs.item()  # bit-identical
            assert out.top_token_ids[j, :n].tolist() == alone[i].top_token_ids[0].tolist()
            assert out.top_logprobs[j, :n].tolist() == alone[i].top_logprobs[0].tolist()
    assert not out.errors.any()


def test_different_seeds_give_different_tokens_and_same_seed_repeats():
    logits = torch.zeros(64, 1000)  # uniform over 1,000 tokens
    rows = [row(seed=s, position=12) for s in range(64)]
    first = SAMPLER(logits, rows).token_ids.tolist()
    assert len(set(first)) >= 50  # 64 fair draws from 1,000 collide a few times at most
    assert SAMPLER(logits, rows).token_ids.tolist() == first
    moved = SAMPLER(logits, [row(seed=s, position=13) for s in range(64)]).token_ids.tolist()
    assert sum(a != b for a, b in zip(first, moved)) >= 50


def test_logits_dtype_and_shape():
    out = SAMPLER(torch.tensor([[1.0, 2.0]], dtype=torch.bfloat16), [row(temperature=0.0)])
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert out.errors.dtype == torch.bool
    empty = SAMPLER(torch.zeros(0, 7), [])
    assert empty.token_ids.shape == (0,) and empty.top_token_ids.shape == (0, 0)
    with pytest.raises(ValueError):
        SAMPLER(torch.zeros(2, 7), [row()])


@pytest.mark.parametrize(
    "changes",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=-2),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(position=-1),
        dict(forced_top_k=0),
        dict(num_logprobs=-1),
    ],
)
def test_sampling_row_rejects_bad_parameters(changes):
    with pytest.raises(ValueError):
        row(**changes)


def test_tiny_temperature_is_near_greedy_not_nan():
    out = SAMPLER(torch.tensor([[1.0, 1.0 + 1e-3, 0.0]]), [row(temperature=1e-300, num_logprobs=3)])
    assert out.token_ids.tolist() == [1] and out.logprobs.item() == 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_tokens_equal_cpu_tokens():
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(3)) * 4
    rows = mixed_rows()
    cpu = SAMPLER(logits, rows)
    gpu = SAMPLER(logits.cuda(), rows)
    # Softmax rounding may differ across devices; tokens agree unless a draw lands within that rounding.
    assert gpu.token_ids.cpu().tolist() == cpu.token_ids.tolist()
    # Another device's log-softmax over VOCAB logits: 1.3e-5 seen on an H200; the bound is 7.7× that.
    assert torch.allclose(gpu.logprobs.cpu(), cpu.logprobs, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_sampler_never_synchronises_the_stream():
    """The speculative path's sampler on a GPU: no host read and no blocking copy (sync debug mode raises on
    either), bans, bias and forced tokens included; the same outputs as without the debug mode."""
    logits = (torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(5)) * 4).cuda()
    rows = [
        dataclasses.replace(r, forced_token_id=7 if i % 5 == 2 else None, logit_bias=((11, 2.5),) if i % 4 == 1 else ())
        for i, r in enumerate(mixed_rows())
    ]
    expected = SAMPLER(logits, rows)  # also the warm-up: first calls may synchronise while they initialise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = SAMPLER(logits, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("token_ids", "logprobs", "top_token_ids", "top_logprobs", "errors"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_a_forced_token_replaces_the_draw_and_keeps_its_processed_logprob():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 4)
    rows = [
        row(top_p=0.8, forced_token_id=1, num_logprobs=2),
        row(top_p=0.8, forced_token_id=4),
        row(temperature=0.0, forced_token_id=2),
        row(top_p=0.8, banned_token_ids=(1,), forced_token_id=1),
    ]
    free = SAMPLER(logits, [dataclasses.replace(r, forced_token_id=None) for r in rows])
    out = SAMPLER(logits, rows)
    assert out.token_ids.tolist() == [1, 4, 2, 1]
    p = SAMPLER.process(logits, rows)
    assert out.logprobs[0] == p.logprobs[0, 1] and math.isfinite(out.logprobs[0])
    assert out.logprobs[1] == -math.inf  # top-p 0.8 dropped token 4: forced anyway, at its logprob
    assert out.logprobs[2] == p.logprobs[2, 2]
    assert out.logprobs[3] == -math.inf  # banned, then forced
    assert torch.equal(out.top_token_ids, free.top_token_ids) and torch.equal(out.top_logprobs, free.top_logprobs)
    assert not out.errors.any()


class DeviceBuilds:
    """A torch function mode recording every ``torch.tensor``/``as_tensor`` given ``device=`` (a list built on
    the device: on CUDA a pageable copy that waits for the stream); entering it returns the record."""

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode

        built: list[str] = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if (
                    getattr(func, "__name__", "") in ("tensor", "as_tensor")
                    and (kwargs or {}).get("device") is not None
                ):
                    built.append(func.__name__)
                return func(*args, **(kwargs or {}))

        self.built, self.mode = built, Mode()

    def __enter__(self) -> list[str]:
        self.mode.__enter__()
        return self.built

    def __exit__(self, *exc: object) -> None:
        self.mode.__exit__(*exc)


def test_logit_bias_builds_no_list_on_the_device():
    """``torch.tensor(list, device=cuda)`` is a pageable copy that waits for the stream, i.e. for the step in
    flight under async scheduling: the bias's indices and values are built on the host and uploaded."""
    from services.worker.sampling.sampler import with_logit_bias

    x = torch.zeros(2, 5)
    with DeviceBuilds() as built_on_device:
        with_logit_bias(x, [row(logit_bias=((4, 5.0),)), row(logit_bias=((0, -1.0), (2, 2.0)))])
    assert x.tolist() == [[0, 0, 0, 0, 5.0], [-1.0, 0, 2.0, 0, 0]]
    assert built_on_device == []


def test_the_sampler_builds_no_list_on_the_device():
    """Every per-row parameter of ``Sampler`` (the speculative path's sampler on a GPU) is built on the host
    and uploaded without a sync: draw bits, greedy flags, forced tokens, the ranked rows, rank and top-p
    limits, temperatures, bans, bias. A list built with ``device=`` is a blocking copy on CUDA."""
    rows = [
        row(temperature=0.0),
        row(top_k=2, seed=3),
        row(top_p=0.6, position=4, banned_token_ids=(1,)),
        row(forced_top_k=3, forced_token_id=2, num_logprobs=2),
        row(logit_bias=((0, 1.5),), seed=-9),
    ]
    logits = torch.randn(len(rows), 6, generator=torch.Generator().manual_seed(0))
    expected = SAMPLER(logits, rows)
    with DeviceBuilds() as built_on_device:
        got = SAMPLER(logits, rows)
        sample_from_uniform(torch.full((2, 4), 0.25), [0.1, 0.9])
    assert built_on_device == []
    for name in ("token_ids", "logprobs", "top_token_ids", "top_logprobs", "errors"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_a_forced_token_outside_the_vocabulary_is_refused():
    with pytest.raises(ValueError, match="forced token id"):
        SAMPLER(torch.zeros(1, 5), [row(forced_token_id=5)])
    with pytest.raises(ValueError, match="forced_token_id"):
        row(forced_token_id=-1)


def test_logit_bias_is_added_before_the_bans_and_the_rest_of_the_pipeline():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]] * 3)
    rows = [
        row(temperature=0.0, logit_bias=((4, 5.0),), num_logprobs=2),
        row(temperature=0.0, logit_bias=((4, 5.0),), banned_token_ids=(4,)),
        row(top_k=2, logit_bias=((0, -2.5), (3, 2.5)), num_logprobs=2),
    ]
    out = SAMPLER(logits, rows)
    assert out.token_ids[:2].tolist() == [4, 0]  # biased to the top; a ban still wins
    biased = logits.clone()
    biased[0, 4] += 5.0
    assert out.logprobs[0] == torch.log_softmax(biased[0], -1)[4]
    assert out.top_token_ids[2].tolist() == [3, 1]  # biased row [0.5, 2, 1, 2.5, -1]
    with pytest.raises(ValueError, match="logit_bias token id"):
        SAMPLER(torch.zeros(1, 5), [row(logit_bias=((5, 1.0),))])
