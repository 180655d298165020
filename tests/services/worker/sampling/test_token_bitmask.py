"""The structured-output token bitmask in both samplers: disallowed tokens are never drawn, greedy takes the best
allowed token, their logprobs are -inf, a row with nothing allowed is an error row; the kernel sampler (interpreted
on CPU, the mask applied inside the kernel's pass 0) gives the CPU sampler's outputs."""

from __future__ import annotations

import math

import pytest
import torch

from services.worker.sampling.kernel_sampler import KernelSampler
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.sampling.token_bitmask import allowed_tokens
from tests.kernels.interpret import interpreter, load_interpreted
from tests.kernels.test_sampler import _check

pytestmark = pytest.mark.usefixtures("one_torch_thread")

VOCAB = 300


def _bitmask(allowed: list[list[int] | None], vocab: int = VOCAB) -> torch.Tensor:
    """int32 words from explicit allowed-id lists (None: all allowed), bit by bit."""
    words = (vocab + 31) // 32
    mask = torch.zeros(len(allowed), words, dtype=torch.int64)
    for i, ids in enumerate(allowed):
        for t in range(words * 32) if ids is None else ids:
            mask[i, t // 32] |= 1 << (t % 32)
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)


def _rows(n: int) -> list[SamplingRow]:
    base = dict(top_k=-1, top_p=1.0, position=3, forced_top_k=None, banned_token_ids=(), num_logprobs=4)
    temps = [1.0, 0.0, 0.7, 1.0, 1.3]
    return [SamplingRow(temperature=temps[i % len(temps)], seed=10 + i, **base) for i in range(n)]


ALLOWED = [[5, 7, 31, 32, 299], [0, 100], None, [63, 64, 65, 200, 201, 202], [298]]


def test_allowed_tokens_reads_bits_least_significant_first():
    mask = _bitmask(ALLOWED)
    got = allowed_tokens(mask, VOCAB, "cpu")
    for i, ids in enumerate(ALLOWED):
        want = set(range(VOCAB)) if ids is None else set(ids)
        assert set(torch.nonzero(got[i]).flatten().tolist()) == want


def test_cpu_sampler_takes_only_allowed_tokens():
    logits = torch.randn(len(ALLOWED), VOCAB, generator=torch.Generator().manual_seed(1)) * 4
    rows = _rows(len(ALLOWED))
    out = Sampler()(logits, rows, token_bitmask=_bitmask(ALLOWED))
    plain = Sampler()(logits, rows)
    for i, ids in enumerate(ALLOWED):
        token = int(out.token_ids[i])
        if ids is None:
            assert token == int(plain.token_ids[i])  # an all-allowed row is untouched
            continue
        assert token in ids
        if rows[i].temperature == 0:
            assert token == max(ids, key=lambda t: float(logits[i, t]))
        finite = [t for t, v in zip(out.top_token_ids[i].tolist(), out.top_logprobs[i].tolist()) if math.isfinite(v)]
        assert len(finite) == min(len(ids), rows[i].num_logprobs) and set(finite) <= set(ids)
    assert not out.errors.any()


def test_a_row_with_nothing_allowed_is_an_error_row():
    logits = torch.randn(2, VOCAB)
    out = Sampler()(logits, _rows(2), token_bitmask=_bitmask([[], None]))
    assert out.errors.tolist() == [True, False]


def test_a_mask_of_the_wrong_height_is_refused():
    with pytest.raises(ValueError, match="rows"):
        Sampler()(torch.randn(2, VOCAB), _rows(2), token_bitmask=_bitmask([None]))


def test_interpreted_kernel_sampler_matches_the_cpu_sampler_under_a_mask():
    logits = torch.randn(len(ALLOWED), VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    rows, mask = _rows(len(ALLOWED)), _bitmask(ALLOWED)
    ref = Sampler()(logits, rows, token_bitmask=mask)
    kernel = KernelSampler(load_interpreted("sampler"))
    with interpreter():
        got = kernel(logits, rows, token_bitmask=mask)
    _check(ref, got)


def test_interpreted_kernel_sampler_makes_a_row_with_nothing_allowed_an_error_row():
    kernel = KernelSampler(load_interpreted("sampler"))
    with interpreter():
        out = kernel(torch.randn(2, VOCAB), _rows(2), token_bitmask=_bitmask([[], None]))
    assert out.errors.tolist() == [True, False]
