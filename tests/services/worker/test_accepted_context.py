"""``write_context`` (the draft's context of a step's accepted rows, written on the device before the host reads
the verdict) leaves the draft rings exactly as ``CacheEngine.write_draft`` of each request's accepted rows does:
a decode request's rows 0 … a, a last prompt chunk's rows (longer than the ring), no row of an error request,
and the other columns untouched."""

from __future__ import annotations

import pytest
import torch

from model.batch_invariant import batch_invariant
from model.deepseek_v41.dspark import DSpark
from services.worker.accepted_context import DeviceVerdict, Sampling, write_context
from services.worker.cache_engine import CacheEngine, ring_size
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
    requests = [(6, 6, 20, 1, 2, False), (6, 6, 3, 2, 5, False), (6, 6, 50, 3, 5, False), (13, 1, 0, 4, 0, False),
                (1, 1, 40, 5, 0, False), (3, 3, 9, 6, 2, True)]
    sampling, start, row = [], 0, 0
    for i, (num_plan, n, first, slot, _, _) in enumerate(requests):
        sampling.append(Sampling(i, str(i), slice(start, start + n), list(range(row, row + num_plan)), slot, first,
                                 []))
        start, row = start + n, row + num_plan
    taps = torch.randn(row, len(cfg.dspark_target_layer_ids) * cfg.hidden_size)
    verdict = DeviceVerdict(torch.tensor([e for *_, e in requests]), torch.tensor([a for *_, a, _ in requests]),
                            torch.zeros(len(requests), 7, dtype=torch.int64))
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
