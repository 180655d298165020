"""The fused sampler kernel vs ``services.worker.sampling.sampler.Sampler``: the same draws, interpreted on CPU
(small vocabularies) and compiled on a GPU (V = 129,280)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from services.worker.sampling.sampler import Sampler, SamplingRow

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _row(temperature=1.0, top_k=0, top_p=1.0, seed=0, position=0, forced=None, banned=(), num_logprobs=0):
    return SamplingRow(temperature, top_k, top_p, seed, position, forced, tuple(banned), num_logprobs)


def _mixed_rows(vocab: int, num_rows: int, gen: torch.Generator) -> list[SamplingRow]:
    """Greedy, temperature only, top-k, top-p, both, forced top-k, bans, tiny T, negative/huge seeds."""
    rows = []
    for i in range(num_rows):
        kind = i % 8
        seed = int(torch.randint(-(2**62), 2**62, (), generator=gen)) * (3 if i % 3 == 0 else 1)
        position = int(torch.randint(0, 100_000, (), generator=gen))
        temperature = [0.0, 1.0, 0.7, 1.0, 1.3, 0.5, 1e-30, 2.0][kind]
        top_k = [0, -1, 40, 0, 25, 0, 3, 1][kind] if kind != 7 else 0
        top_p = [1.0, 1.0, 1.0, 0.9, 0.8, 0.95, 1.0, 0.3][kind]
        forced = 60 if kind == 5 else None
        banned = tuple(int(t) for t in torch.randint(0, vocab, (3,), generator=gen)) if kind in (1, 4) else ()
        if kind == 0 and i % 16 == 0:
            top_p = 0.5  # a greedy row whose logprobs come from the nucleus
        rows.append(_row(temperature, top_k, top_p, seed, position, forced, banned, num_logprobs=5 * (i % 3 == 1)))
    return rows


def _check(ref, got, tol=1e-5):
    """Identical ids and error flags; logprobs equal up to ``tol`` (same -inf pattern).

    A logprob is x − max − log Σ exp(x − max): two fp32 orders of that sum (tree reductions on both sides)
    differ by ≲ log2(V)·u32 ≈ 1e-6 relative at V = 129,280, which is absolute after the log, and each exp's
    own error (≤ 2 ulp) adds ≲ 1.2e-7. The default 1e-5 is 10× that; the GPU tests allow 2e-5 for the fast
    exp (ex2.approx: ≤ 2^-22 relative per term, 2× the interpreter's numpy exp)."""
    for name in ("token_ids", "top_token_ids", "errors"):
        assert torch.equal(getattr(got, name).cpu(), getattr(ref, name).cpu()), (name, getattr(got, name))
    worst = 0.0
    for name in ("logprobs", "top_logprobs"):
        a, b = getattr(got, name).cpu(), getattr(ref, name).cpu()
        assert torch.equal(torch.isinf(a), torch.isinf(b)), name
        finite = torch.isfinite(b)
        if finite.any():
            worst = max(worst, (a[finite] - b[finite]).abs().max().item())
    assert worst <= tol, worst
    return worst


class _Builds:
    """Counts ``torch.tensor`` builds from Python data (the host cost that grows with the rows)."""

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode

        counts = self.counts = []

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") == "tensor":
                    counts.append(1)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()

    def __call__(self, fn) -> int:
        self.counts.clear()
        with self.mode:
            fn()
        return len(self.counts)


@pytest.mark.parametrize("banned", [(), (3, 9)])
def test_sampling_tensors_build_one_tensor_per_parameter_not_one_per_row(banned):
    """The per-step host work may not grow a torch call per row (it did: one ban tensor per row, even for
    rows that ban nothing): the same builds for 1 row as for 64, at most one per parameter."""
    from kernels.sampler import SamplingTensors, sampling_tensors

    def rows(n):
        return [_row(0.7, 50 * (i % 2), 0.9, seed=i, position=i, banned=banned) for i in range(n)]

    builds = _Builds()
    one, many = builds(lambda: sampling_tensors(rows(1))), builds(lambda: sampling_tensors(rows(64)))
    assert one == many <= len(dataclasses.fields(SamplingTensors)), (one, many)


def test_sampling_tensors_hold_each_rows_parameters():
    """Every field against ``SamplingRow``'s own definitions: the rank limit property, ceil(top_p · 2³¹) in
    float64 (``top_p_mass_limit``), the seed mod 2⁶⁴ as two's complement, bans −1 padded to num_bans."""
    from kernels.sampler import sampling_tensors, top_p_mass_limit

    gen = torch.Generator().manual_seed(7)
    rows = _mixed_rows(100, 24, gen) + [
        _row(seed=-1),
        _row(seed=2**64 - 1),
        _row(seed=2**64 + 5, top_p=1e-9),
        _row(top_k=5, forced=None, top_p=0.999999),
        _row(top_k=-1, forced=None),
    ]
    rows = [
        dataclasses.replace(r, forced_top_k=[None, 1, 4, 80][i % 4], forced_token_id=[None, 0, 99][i % 3])
        for i, r in enumerate(rows)
    ]
    got = sampling_tensors(rows, num_bans=5)
    assert got.temperature.dtype == torch.float32 and got.rank_limit.dtype == torch.int32
    assert got.temperature.tolist() == torch.tensor([r.temperature for r in rows], dtype=torch.float32).tolist()
    assert got.rank_limit.tolist() == [r.rank_limit or 0 for r in rows]
    assert torch.equal(got.mass_limit, top_p_mass_limit(torch.tensor([r.top_p for r in rows], dtype=torch.float64)))
    assert got.seed.tolist() == [(r.seed % 2**64) - 2**64 * (r.seed % 2**64 >= 2**63) for r in rows]
    assert got.position.tolist() == [r.position for r in rows]
    assert got.banned.tolist() == [list(r.banned_token_ids) + [-1] * (5 - len(r.banned_token_ids)) for r in rows]
    assert got.forced.tolist() == [-1 if r.forced_token_id is None else r.forced_token_id for r in rows]
    assert sampling_tensors(rows).banned.shape == (len(rows), 4)  # the longest list (3), to a power of two
    assert sampling_tensors(rows[2:4]).banned.shape == (2, 0)
    with pytest.raises(ValueError, match="row 1 bans 3 tokens, more than num_bans=2"):
        sampling_tensors(rows, num_bans=2)


def _interpreted_sample(logits, rows, block, case=0):
    k = load_interpreted("sampler")
    width = max(r.num_logprobs for r in rows)
    with interpreter():
        return k.sample(logits, k.sampling_tensors(rows), num_logprobs=width, case=case, block=block)


def test_sampler_interpreted_matches_cpu_sampler_mixed_rows():
    gen = torch.Generator().manual_seed(0)
    vocab, num_rows = 1200, 12
    logits = torch.randn(num_rows, vocab, generator=gen) * 2.5
    logits[1::4, 7] = 12.0  # peaked rows: top-p keeps few tokens
    rows = _mixed_rows(vocab, num_rows, gen)
    _check(Sampler()(logits, rows), _interpreted_sample(logits, rows, block=512))


def test_sampler_interpreted_ties_at_the_cuts():
    """Few distinct logit values: the top-k and top-p cuts fall inside runs of ties (lower ids first),
    −0 and +0 tie, and a top-k larger than the finite logits cuts inside the banned (-inf) ranks."""
    gen = torch.Generator().manual_seed(1)
    vocab = 700
    logits = torch.randint(-3, 3, (8, vocab), generator=gen).float() * 0.5
    logits[2] = torch.where(logits[2] == 0, torch.tensor(-0.0), logits[2])
    logits[3, : vocab // 2] = -0.0
    rows = [
        _row(1.0, 50, seed=3),
        _row(0.8, 0, 0.6, seed=4),
        _row(1.0, 130, 0.7, seed=5, position=2),
        _row(1.0, 400, seed=6, num_logprobs=9),
        _row(0.0, 10, 0.5),
        _row(2.0, 0, 0.99, seed=-1, banned=(0, 1, 2, 650)),
        _row(1.0, 690, 0.999, seed=9, banned=range(5, 16)),
        _row(0.9, 2, 1.0, seed=2**63 + 5),
    ]
    ref = Sampler()(logits, rows)
    _check(ref, _interpreted_sample(logits, rows, block=256))
    # 64-wide chunks: 11 chunks in two groups of 8, so cuts and draws can land in the later group.
    some = [1, 3, 6]
    _check(
        Sampler()(logits[some], [rows[i] for i in some]),
        _interpreted_sample(logits[some], [rows[i] for i in some], block=64),
    )


def test_sampler_interpreted_error_rows_and_resample_case():
    vocab = 300
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(2))
    logits[0, 5] = math.nan
    logits[1, 9] = math.inf
    logits[2] = -math.inf
    logits[2, 17] = 3.0  # its only finite logit is banned
    rows = [_row(seed=1), _row(seed=2), _row(seed=3, banned=(17,)), _row(0.6, 10, 0.9, seed=4, position=7)]
    got = _interpreted_sample(logits, rows, block=128)
    _check(Sampler()(logits, rows), got)
    assert got.errors.tolist() == [True, True, True, False]
    # case 1 (resample) draws other bits: compare with a CPU pick from the same processed distribution.
    from kernels.philox import DrawCase, draw_bits
    from services.worker.sampling.sampler import pick_from_bits

    p = Sampler().process(logits[3:], rows[3:])
    expected = pick_from_bits(p.probs, draw_bits([4], [7], DrawCase.RESAMPLE))
    resampled = _interpreted_sample(logits[3:], rows[3:], block=128, case=DrawCase.RESAMPLE)
    assert resampled.token_ids.tolist() == expected.tolist()


def test_sampler_interpreted_draw_ignores_batch_neighbours():
    """A row's draw is a function of its own logits, seed and position: not of its index or companions."""
    gen = torch.Generator().manual_seed(3)
    vocab = 512
    logits = torch.randn(4, vocab, generator=gen) * 2
    rows = [
        _row(1.0, 0, 0.9, seed=11, position=4),
        _row(0.8, 30, seed=12, position=5),
        _row(1.0, seed=13, position=6),
        _row(0.0),
    ]
    a = _interpreted_sample(logits, rows, block=256)
    perm = [2, 0, 3, 1]
    other = torch.randn(2, vocab, generator=gen) * 5
    b = _interpreted_sample(
        torch.cat((logits[perm], other)), [rows[i] for i in perm] + [_row(seed=1), _row(seed=2)], block=256
    )
    assert torch.equal(b.token_ids[:4], a.token_ids[perm]) and torch.equal(b.logprobs[:4], a.logprobs[perm])


@pytest.mark.parametrize("case", ["greedy", "top-p 0.9 T 0.7"])
def test_sampler_bench_problem_interpreted(case):
    """The benchmark's problem builder at a reduced vocabulary, on CPU: same draws as the CPU sampler."""
    from services.bench.kernels.sampler import sampler_problem

    logits, rows = sampler_problem(2, case, torch.Generator().manual_seed(4), device="cpu", vocab=1024)
    _check(Sampler()(logits, rows), _interpreted_sample(logits, rows, block=512))


def _gpu_problem(num_rows: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    vocab = 129280
    logits = torch.randn(num_rows, vocab, device="cuda", generator=gen) * 2
    # A few confident tokens per row, as a language model has: the nucleus is small for many rows.
    hot = torch.randint(0, vocab, (num_rows, 8), device="cuda", generator=gen)
    logits.scatter_(1, hot, torch.rand(num_rows, 8, device="cuda", generator=gen) * 12 + 4)
    # From kind 3 on: R = 1 is a sampled top-p 0.9 row.
    rows = _mixed_rows(vocab, num_rows + 3, torch.Generator().manual_seed(seed))[3:]
    return logits.to(dtype), rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_rows", [1, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sampler_gpu_matches_sampler(num_rows, dtype):
    from kernels.sampler import sample, sampling_tensors

    logits, rows = _gpu_problem(num_rows, dtype, num_rows)
    out = Sampler()(logits, rows)
    got = sample(logits, sampling_tensors(rows, "cuda"), num_logprobs=max(r.num_logprobs for r in rows))
    # Same fp32 maths, different exp and summation order: logprobs agree to a few ulp of log(sum).
    _check(out, got, tol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_gpu_cuda_graph_replay_reads_new_parameters():
    from kernels.sampler import sample, sampling_tensors

    logits, rows = _gpu_problem(64, torch.float32, 7)
    params = sampling_tensors(rows, "cuda")
    sample(logits, params, num_logprobs=5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = sample(logits, params, num_logprobs=5)
    moved = [
        _row(
            r.temperature or 1.0,
            r.top_k,
            r.top_p,
            r.seed,
            r.position + 1,
            r.forced_top_k,
            r.banned_token_ids,
            num_logprobs=5,
        )
        for r in rows
    ]
    new = sampling_tensors(moved, "cuda", num_bans=params.banned.shape[1])
    for name in ("temperature", "rank_limit", "mass_limit", "seed", "position", "banned"):
        getattr(params, name).copy_(getattr(new, name))
    graph.replay()
    _check(Sampler()(logits, moved), got, tol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampler_gpu_parameters_and_draws_never_synchronise_the_stream():
    """``sampling_tensors(rows, "cuda")`` and the kernel under sync debug mode "error": the parameters are
    uploaded without a sync (a list built on the device would be a blocking copy); the same draws."""
    from kernels.sampler import sample, sampling_tensors

    rows = _mixed_rows(129_280, 64, torch.Generator().manual_seed(11))
    logits = (torch.randn(64, 129_280, generator=torch.Generator().manual_seed(12)) * 3).cuda()
    expected = sample(logits, sampling_tensors(rows, "cuda"), num_logprobs=5)  # the warm-up and compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = sample(logits, sampling_tensors(rows, "cuda"), num_logprobs=5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for name in ("token_ids", "logprobs", "top_token_ids", "top_logprobs", "errors"):
        assert torch.equal(getattr(got, name), getattr(expected, name)), name


def test_sampler_interpreted_forced_tokens_match_cpu_sampler():
    gen = torch.Generator().manual_seed(3)
    vocab, num_rows = 700, 8
    logits = torch.randn(num_rows, vocab, generator=gen) * 2.5
    rows = [
        dataclasses.replace(r, forced_token_id=[5, None, 699, 0][i % 4], num_logprobs=3)
        for i, r in enumerate(_mixed_rows(vocab, num_rows, gen))
    ]
    ref = Sampler()(logits, rows)
    assert ref.token_ids[0::4].tolist() == [5, 5] and ref.token_ids[2::4].tolist() == [699, 699]
    assert torch.isinf(ref.logprobs).any()  # some forced token lies outside its row's kept set
    _check(ref, _interpreted_sample(logits, rows, block=256))


def test_kernel_sampler_interpreted_adds_logit_bias_as_the_cpu_sampler_does():
    from services.worker.sampling.kernel_sampler import KernelSampler

    gen = torch.Generator().manual_seed(4)
    vocab, num_rows = 600, 6
    logits = torch.randn(num_rows, vocab, generator=gen) * 2.0
    rows = [
        dataclasses.replace(r, logit_bias=((7, 30.0), (i, -3.5)), num_logprobs=2)
        for i, r in enumerate(_mixed_rows(vocab, num_rows, gen))
    ]
    ref = Sampler()(logits, rows)
    with interpreter():
        got = KernelSampler(load_interpreted("sampler"))(logits, rows)
    _check(ref, got)
    assert (ref.top_token_ids[:, 0] == 7).all()  # +30 puts token 7 first in every row
