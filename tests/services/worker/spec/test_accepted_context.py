"""``write_context`` (the draft's context of a step's accepted rows, written on the device before the host reads
the verdict) leaves the draft rings exactly as ``CacheEngine.write_draft`` of each request's accepted rows does:
a decode request's rows 0 … a, a last prompt chunk's rows (longer than the ring), no row of an error request,
and the other columns untouched. ``emitted_output`` is the sampler's output with the emitted tokens forced."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from model.batch_invariant import batch_invariant
from model.deepseek_v41.dspark import DSpark
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.spec.accepted_context import DeviceVerdict, Sampling, emitted_output, write_context
from services.worker.state.cache_engine import CacheEngine, ring_size
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES


@pytest.mark.parametrize("case", DRAFT_CASES[:2], ids=["window-8", "window-4"])
def test_the_device_write_equals_write_draft_of_the_accepted_rows(case):
    cfg = case.cfg
    w = cfg.sliding_window
    torch.manual_seed(0)
    draft = DSpark(cfg).eval()
    # (plan rows, sampled rows, first position, slot, accepted, error): a partly accepted decode request, an
    # all-accepted one, one whose rows outnumber the ring (window 4), a last prompt chunk longer than the
    # ring, a decode row without drafts, and an error request.
    requests = [
        (6, 6, 20, 1, 2, False),
        (6, 6, 3, 2, 5, False),
        (6, 6, 50, 3, 5, False),
        (13, 1, 0, 4, 0, False),
        (1, 1, 40, 5, 0, False),
        (3, 3, 9, 6, 2, True),
    ]
    sampling, start, row = [], 0, 0
    for i, (num_plan, n, first, slot, _, _) in enumerate(requests):
        sampling.append(Sampling(i, str(i), slice(start, start + n), list(range(row, row + num_plan)), slot, first, []))
        start, row = start + n, row + num_plan
    taps = torch.randn(row, len(cfg.dspark_target_layer_ids) * cfg.hidden_size)
    verdict = DeviceVerdict(
        torch.tensor([e for *_, e in requests]),
        torch.tensor([a for *_, a, _ in requests]),
        torch.zeros(len(requests), 7, dtype=torch.int64),
    )
    got = CacheEngine(cfg, 16, num_blocks=2, num_state_slots=8, ring=ring_size(cfg), draft=True)
    want = CacheEngine(cfg, 16, num_blocks=2, num_state_slots=8, ring=ring_size(cfg), draft=True)
    for k in range(len(draft.stages)):
        noise = torch.randn(got.draft_ring(k).shape)  # the columns no accepted row reaches keep these
        got.draft_ring(k).copy_(noise)
        want.draft_ring(k).copy_(noise)
    with torch.no_grad(), batch_invariant():
        write_context(draft, sampling, verdict, taps, got)
        for s, (num_plan, n, first, slot, a, error) in zip(sampling, requests):
            if error:
                continue
            rows = s.rows if n == 1 else s.rows[: a + 1]
            positions = torch.arange(first, first + len(rows)).unsqueeze(0)
            ctx = draft.context(taps[rows].unsqueeze(0))
            want.write_draft(slot, first, [draft.context_kv(k, ctx, positions)[0] for k in range(len(draft.stages))])
    for k in range(len(draft.stages)):
        assert torch.equal(got.draft_ring(k), want.draft_ring(k)), k
    assert w in (8, 4)


@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_the_emitted_output_equals_the_sampler_with_the_emitted_tokens_forced(num_logprobs):
    """Rows of 4 requests (3 + 1 + 2 + 3 sampled rows): partly accepted, a lone row, fully accepted, and an error
    request (a NaN logit in one row). Every field equals ``Sampler.__call__`` over the same logits with each
    row's token forced (the emitted tokens, 0 elsewhere), which the speculator called before."""
    torch.manual_seed(0)
    vocab, spans = 50, [3, 1, 2, 3]
    logits = torch.randn(sum(spans), vocab)
    logits[7, 4] = math.nan  # the last request's second row
    rows = [
        SamplingRow(
            temperature=[0.0, 0.7, 0.0, 1.0][i],
            top_k=[0, 5, 0, 0][i],
            top_p=1.0,
            seed=5,
            position=10 + r,
            forced_top_k=None,
            banned_token_ids=(3,),
            num_logprobs=num_logprobs,
        )
        for i, n in enumerate(spans)
        for r in range(n)
    ]
    sampling, start = [], 0
    for i, n in enumerate(spans):
        sampling.append(
            Sampling(i, str(i), slice(start, start + n), list(range(start, start + n)), i, 0, [1] * (n - 1))
        )
        start += n
    tokens = torch.randint(0, vocab, (4, 3))
    verdict = DeviceVerdict(torch.tensor([False, False, False, True]), torch.tensor([1, 0, 1, 2]), tokens)
    sampler = Sampler()
    processed = sampler.process(logits, rows, rank_all=num_logprobs > 0)
    got = emitted_output(processed, verdict, sampling, num_logprobs)
    forced = [0] * len(rows)
    for s, a, error in zip(sampling, [1, 0, 1, 2], [False, False, False, True]):
        if not error:
            forced[s.span.start : s.span.start + a + 1] = tokens[s.index, : a + 1].tolist()
    want = sampler(logits, [dataclasses.replace(row, forced_token_id=t) for row, t in zip(rows, forced)])
    assert forced[:3] == tokens[0, :2].tolist() + [0] and forced[6:] == [0, 0, 0]
    for field in dataclasses.fields(want):
        assert torch.equal(getattr(got, field.name), getattr(want, field.name)), field.name
