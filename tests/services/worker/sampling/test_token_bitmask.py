"""The structured-output token bitmask in both samplers: disallowed tokens are never drawn, greedy takes the best
allowed token, their logprobs are -inf, a row with nothing allowed is an error row; the kernel sampler (interpreted
on CPU, the mask applied inside the kernel's pass 0) gives the CPU sampler's outputs."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from services.worker.sampling.kernel_sampler import KernelSampler
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.sampling.token_bitmask import allowed_tokens
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


def _packed(allowed: torch.Tensor) -> torch.Tensor:
    """int32 words [n, ceil(V / 32)] from a bool [n, V] (bit t of word w: token 32w + t)."""
    n, vocab = allowed.shape
    words = (vocab + 31) // 32
    bits = torch.zeros(n, words * 32, dtype=torch.int64, device=allowed.device)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(n, words, 32) << torch.arange(32, device=allowed.device)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _masks(num_rows: int, vocab: int, seed: int) -> torch.Tensor:
    """Rows allowing about half the vocabulary, a few tokens, one token, everything, and nothing, in turn."""
    gen = torch.Generator().manual_seed(seed)
    kinds = []
    for i in range(num_rows):
        row = torch.rand(vocab, generator=gen) < [0.5, 2e-3, 0.0, 1.0, 0.0][i % 5]
        if i % 5 == 2:  # exactly one allowed token
            row[int(torch.randint(0, vocab, (1,), generator=gen))] = True
        kinds.append(row)
    return _packed(torch.stack(kinds))


def _masked_problem(num_rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, list[SamplingRow], torch.Tensor]:
    """Logits with a few confident tokens per row (kernels' test recipe), its mixed sampling rows (greedy, top-k,
    top-p, bans, logprobs), and ``_masks``."""
    from tests.kernels.test_sampler import _mixed_rows

    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(num_rows, vocab, generator=gen) * 2
    hot = torch.randint(0, vocab, (num_rows, 8), generator=gen)
    logits.scatter_(1, hot, torch.rand(num_rows, 8, generator=gen) * 12 + 4)
    return logits, _mixed_rows(vocab, num_rows, gen), _masks(num_rows, vocab, seed)


def test_interpreted_kernel_sampler_matches_the_cpu_sampler_under_mixed_masks():
    """The GPU test's problem at a small vocabulary, interpreted: the same tokens, top ids and error rows."""
    logits, rows, mask = _masked_problem(10, 2048, 3)
    ref = Sampler()(logits, rows, token_bitmask=mask)
    with interpreter():
        got = KernelSampler(load_interpreted("sampler"))(logits, rows, token_bitmask=mask)
    _check(ref, got)
    assert ref.errors[4::5].all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_kernel_sampler_matches_the_cpu_sampler_under_a_mask(dtype):
    """The compiled kernel at V = 129,280 on CUDA (the mask applied in its pass 0) against the CPU sampler under the
    same mask: same tokens, top ids and error rows (the nothing-allowed rows); logprobs within the GPU tolerance."""
    logits, rows, mask = _masked_problem(64, 129280, 5)
    logits, mask = logits.to(device="cuda", dtype=dtype), mask.cuda()
    ref = Sampler()(logits, rows, token_bitmask=mask)  # the torch sampler on the same device (the kernels' GPU test)
    got = KernelSampler()(logits, rows, token_bitmask=mask)
    _check(ref, got, tol=2e-5)
    assert ref.errors[4::5].all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_mask_is_an_input_of_the_sampler_kernel_in_a_cuda_graph():
    """A captured sample replays with the mask tensor's new contents (written in place, as a step's upload does)."""
    from kernels.sampler import sample, sampling_tensors

    logits, rows, first = _masked_problem(16, 129280, 9)
    params = sampling_tensors(rows, "cuda")
    gpu_logits, mask = logits.cuda(), first.cuda()
    width = max(r.num_logprobs for r in rows)
    sample(gpu_logits, params, num_logprobs=width, token_bitmask=mask)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = sample(gpu_logits, params, num_logprobs=width, token_bitmask=mask)
    new = _masks(16, logits.shape[1], 10)
    mask.copy_(new.cuda())
    graph.replay()
    _check(Sampler()(gpu_logits, rows, token_bitmask=new.cuda()), got, tol=2e-5)
