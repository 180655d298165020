"""device_sampling: ``process`` on a packed table ``==`` ``Sampler.process`` on every field, for every kind of row."""

import dataclasses
import math

import pytest
import torch

from services.worker.sampling.device_sampling import (
    MIN_CAPACITY,
    SamplingKey,
    float32_bits,
    float32_of_bits,
    process,
    scale,
)
from services.worker.sampling.sampler import Sampler, SamplingRow

VOCAB = 97


def row(**changes) -> SamplingRow:
    fields = dict(
        temperature=1.0, top_k=-1, top_p=1.0, seed=0, position=0, forced_top_k=None, banned_token_ids=(), num_logprobs=0
    )
    fields.update(changes)
    return SamplingRow(**fields)


ROWS = [
    row(temperature=0),  # greedy: logprobs at T = 1
    row(temperature=0.7, top_k=5),
    row(temperature=1.3, top_p=0.8),
    row(temperature=0.5, top_k=20, top_p=0.6, forced_top_k=9),
    row(temperature=1e-50),  # rounds to float32 0: clamped to float32 tiny (else the max logit would be 0 / 0)
    row(banned_token_ids=(3, 4, 50), logit_bias=((7, 2.5), (3, 1.0), (96, -4.25))),
    row(temperature=0.9, top_p=0.95, logit_bias=((0, 100.0),)),
    row(banned_token_ids=tuple(range(VOCAB))),  # nothing left: an error row
    row(temperature=0.8, top_k=3),  # a NaN logit: an error row
    row(temperature=2.0, num_logprobs=4),
]


def logits_of(rows, extra: int = 0) -> torch.Tensor:
    """Logits with ties (rounded to 0.25) so that the ranking's tie rule matters; row 8 holds a NaN."""
    x = (torch.randn(len(rows) + extra, VOCAB, generator=torch.Generator().manual_seed(5)) * 3 * 4).round() / 4
    x[8, 11] = math.nan
    return x


def static_process(logits: torch.Tensor, rows, rank_all: bool, num_rows: int):
    """What the static verify's run does: the rows packed (padded to ``num_rows``), one upload, ``process``."""
    key = SamplingKey.of(rows, rank_all)
    table = torch.tensor(key.pack(rows, num_rows, VOCAB), dtype=torch.int64)
    assert table.numel() == key.size(num_rows)
    return key, process(logits, key.unpack(table, num_rows))


@pytest.mark.parametrize("rank_all", [False, True])
def test_process_equals_the_samplers_on_every_field(rank_all):
    """Padding rows (stale logits of a larger batch) ride along and change nothing."""
    logits = logits_of(ROWS, extra=6)
    want = Sampler().process(logits[: len(ROWS)], ROWS, rank_all=rank_all)
    key, got = static_process(logits, ROWS, rank_all, logits.shape[0])
    assert key == SamplingKey(True, MIN_CAPACITY * 8, MIN_CAPACITY)
    n = len(ROWS)
    for name in ("banned", "logprobs", "probs", "errors"):
        assert torch.equal(getattr(got, name)[:n], getattr(want, name)), name
    assert got.errors[:n].tolist() == [i in (7, 8) for i in range(n)]
    # Every row is ranked; the sampler's ranked rows (all of them when rank_all) have the same order.
    assert torch.equal(got.ranked_rows, torch.arange(logits.shape[0]))
    assert torch.equal(got.order[want.ranked_rows], want.order)
    if rank_all:
        assert torch.equal(got.ranked_rows[:n], want.ranked_rows)


def test_error_rows_are_the_samplers_for_every_kind_of_non_finite_logit():
    """A NaN (alone, or beside a +inf or a -inf), a +inf, nothing finite (all -inf, or -inf and +inf), and rows
    that stay valid (some -inf beside finite values; one finite value among -inf): the same error rows and
    values as ``Sampler.process``."""
    inf, nan = math.inf, math.nan
    logits = torch.tensor(
        [
            [nan, 1.0, 2.0, 0.0],
            [inf, 1.0, 2.0, 0.0],
            [-inf, -inf, -inf, -inf],
            [-inf, inf, -inf, -inf],
            [nan, inf, -inf, 0.0],
            [nan, -inf, -inf, -inf],
            [-inf, 1.0, -inf, 3.0],
            [-inf, -inf, 5.0, -inf],
            [0.5, 1.0, 2.0, 0.0],
        ]
    )
    rows = [row(temperature=0.7)] * logits.shape[0]
    want = Sampler().process(logits, rows)
    _, got = static_process(logits, rows, False, logits.shape[0])
    assert got.errors.tolist() == [True] * 6 + [False] * 3
    for name in ("banned", "logprobs", "probs", "errors"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_rows_that_ask_for_no_ranking_are_not_sorted():
    rows = [row(temperature=0), row(temperature=0.6), row(banned_token_ids=(1,))]
    logits = logits_of(ROWS)[: len(rows) + 1]  # one padding row
    want = Sampler().process(logits[: len(rows)], rows)
    key, got = static_process(logits, rows, False, logits.shape[0])
    assert key == SamplingKey(False, MIN_CAPACITY, 0)
    for name in ("banned", "logprobs", "probs", "errors", "ranked_rows", "order"):
        assert torch.equal(getattr(got, name)[: len(rows)], getattr(want, name)), name


NON_FINITE = [
    [math.nan, 1.0, 2.0, 0.0],
    [math.inf, 1.0, 2.0, 0.0],
    [-math.inf] * 4,
    [math.nan, math.inf, -math.inf, 0.0],
    [-math.inf, 1.0, -math.inf, 3.0],
    [0.5, -0.0, 0.0, -2.0],
    [-0.0, 0.0, -1.0, -math.inf],
]


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("rank", [False, True])
def test_scale_without_the_banned_logits_gives_the_samplers_distributions(temperature, rank):
    """``keep_banned=False`` zeroes error rows after the division and keeps no masked copy; ``unit_temperatures``
    skips the division by 1: the probs and logprobs stay ``Sampler.process``'s (error rows, ±0 maxima, -inf)."""
    logits = torch.tensor(NON_FINITE)
    rows = [
        row(temperature=temperature, top_k=3 if rank else -1, banned_token_ids=(2,) if i == 4 else ())
        for i in range(logits.shape[0])
    ]
    want = Sampler().process(logits, rows, rank_all=rank)
    key = SamplingKey.of(rows, rank)
    table = torch.tensor(key.pack(rows, len(rows), 4), dtype=torch.int64)
    sampling = dataclasses.replace(key.unpack(table, len(rows)), unit_temperatures=temperature == 1.0)
    got = scale(logits, sampling, keep_banned=False)
    assert (got.banned is None) == (not rank)
    assert got.errors.tolist() == want.errors.tolist() == [True] * 4 + [False] * 3
    assert torch.equal(torch.softmax(got.scaled, dim=-1), want.probs)
    assert torch.equal(torch.log_softmax(got.scaled, dim=-1), want.logprobs)
    kept = scale(logits, sampling, keep_banned=True)
    assert torch.equal(torch.softmax(kept.scaled, dim=-1), want.probs)
    assert torch.equal(kept.banned, want.banned)


def test_the_key_buckets_capacities_and_leaves_a_twice_biased_token_to_the_sampler():
    assert SamplingKey.of([row()], False) == SamplingKey(False, 0, 0)
    assert SamplingKey.of([row(num_logprobs=1)], False) == SamplingKey(True, 0, 0)
    assert SamplingKey.of([row()], True) == SamplingKey(True, 0, 0)
    many = row(banned_token_ids=tuple(range(17)), logit_bias=((1, 1.0),))
    assert SamplingKey.of([many, row(top_p=0.5)], False) == SamplingKey(True, 32, 16)
    assert SamplingKey.of([row(logit_bias=((1, 1.0), (1, 2.0)))], False) is None
    with pytest.raises(ValueError, match="do not fit"):
        SamplingKey(False, 16, 0).pack([many], 1, VOCAB)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        SamplingKey(False, 16, 0).pack([row(banned_token_ids=(VOCAB,))], 1, VOCAB)


def test_float32_bits_round_trip_exactly():
    values = [1.0, 0.7, 1e-30, torch.finfo(torch.float32).tiny, 3.4e38, -4.25, 0.0]
    bits = torch.tensor([float32_bits(v) for v in values], dtype=torch.int64)
    assert torch.equal(float32_of_bits(bits), torch.tensor(values, dtype=torch.float32))
