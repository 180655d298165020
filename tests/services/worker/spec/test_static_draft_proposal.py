"""The static proposal (services/worker/spec/static_draft_proposal.py: fixed-shape buffers for a power-of-two bucket of
rows, what a CUDA graph captures, run eagerly here) gives the eager proposal's drafts, draft distributions and
confidences ``==`` in the batch-invariant mode, in both sampling modes, with placeholder rows padding the
bucket; on the GPU a graph's replay equals the same static proposal run eagerly."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch
from torch import nn

from model.batch_invariant import batch_invariant
from model.deepseek_v41.dspark import DraftContext, DSpark
from services.worker.spec.draft_proposal import HostInputs, ProposalInputs, propose
from services.worker.spec.static_draft_proposal import DraftProposalGraphs, ProposalKey, StaticDraftProposal, bucket
from services.worker.state.cache_engine import CacheEngine, ring_size
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES
from tests.services.worker.spec.test_draft_proposal import ROWS, row

CFG = DRAFT_CASES[0].cfg
V = CFG.vocab_size
NEXTN = CFG.dspark_block_size
# Positions from 0 (an empty window) to past the window (a full one).
STARTS = [0, 3, 17, 40, CFG.sliding_window + 9, 2, 63]


@pytest.fixture(scope="module")
def setup():
    """A model with a draft (its embedding and head random too) and a cache whose draft rings hold random K=V."""
    torch.manual_seed(0)
    model = types.SimpleNamespace(
        cfg=CFG,
        draft=DSpark(CFG).eval(),
        embed=nn.Embedding(V, CFG.hidden_size),
        head=nn.Linear(CFG.hidden_size, V, bias=False),
    )
    cache = CacheEngine(CFG, 16, num_blocks=2, num_state_slots=len(ROWS) + 1, ring=ring_size(CFG), draft=True)
    for stage in range(len(model.draft.stages)):
        ring = cache.draft_ring(stage)
        ring.copy_(torch.randn(ring.shape))
    return model, cache


def eager(model, cache, rows, tokens, starts, slots, mode):
    inputs = ProposalInputs.build(rows, tokens, starts, slots, NEXTN, V, mode, torch.device("cpu"))
    kv, positions = cache.read_draft(inputs.state_slots, inputs.anchor_positions)
    blocks = model.draft.blocks_from_context(
        DraftContext(kv, positions, inputs.anchor_positions), inputs.anchor_tokens, model.embed, model.head
    )
    return propose(model.draft, blocks, inputs, NEXTN)


GREEDY = [dataclasses.replace(r, temperature=0.0) for r in ROWS]
CASES = {
    "mixed-7": ROWS,
    "mixed-3": ROWS[2:5],
    "greedy-5": GREEDY[:5],
    "one": ROWS[1:2],
    "bans-past-capacity": [
        row(0.8, seed=5, banned=tuple(range(20)), bias=tuple((t, 0.5) for t in range(30, 50))),
        row(0.0, banned=(7,)),
    ],
}


@pytest.mark.parametrize("rows", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_the_static_proposal_equals_the_eager_one_with_padding(setup, mode, rows):
    model, cache = setup
    b = len(rows)
    tokens, starts, slots = [(5 * i + 11) % V for i in range(b)], STARTS[:b], list(range(1, b + 1))
    with torch.no_grad(), batch_invariant():
        want = eager(model, cache, rows, tokens, starts, slots, mode)
        graphs = DraftProposalGraphs(model, NEXTN, mode, use_graphs=False)
        host = HostInputs.pack(rows, tokens, starts, slots, NEXTN, V, mode)
        got = graphs.propose(host, cache)
    ((key, static),) = graphs.static.items()
    assert key == ProposalKey.of(host) and key.num_rows == bucket(b) and static.ints.shape[0] == key.num_rows
    if b in (7, 3, 5):  # real padding rows ran
        assert key.num_rows > b
    assert torch.equal(got.drafts, want.drafts)
    assert torch.equal(got.probs, want.probs)
    assert torch.equal(got.confidences, want.confidences)


def test_a_refill_with_other_rows_of_the_same_key_replaces_every_input(setup):
    """The buffers are reused: a second batch (other anchors, seeds, slots) gets its own proposal, not the first's."""
    model, cache = setup
    mode = "deterministic"
    with torch.no_grad(), batch_invariant():
        graphs = DraftProposalGraphs(model, NEXTN, mode, use_graphs=False)
        first = ROWS[1:4]
        second = [dataclasses.replace(r, seed=r.seed + 1000) for r in ROWS[2:4]] + [ROWS[1]]
        graphs.propose(HostInputs.pack(first, [1, 2, 3], STARTS[1:4], [1, 2, 3], NEXTN, V, mode), cache)
        got = graphs.propose(HostInputs.pack(second, [9, 8, 7], [5, 44, 0], [4, 6, 2], NEXTN, V, mode), cache)
        want = eager(model, cache, second, [9, 8, 7], [5, 44, 0], [4, 6, 2], mode)
    assert len(graphs.static) == 1  # both batches fit the same key (3 rows: the bucket of 4)
    assert torch.equal(got.drafts, want.drafts) and torch.equal(got.probs, want.probs)
    assert torch.equal(got.confidences, want.confidences)


def test_prepared_buckets_serve_every_greedy_batch_without_a_new_static_proposal(setup):
    """``capture`` with the greedy buckets up to 5 rows builds (with graphs: captures) 1, 2, 4 and 8 before any
    step; greedy batches of 1 to 5 rows then reuse those, so no capture can happen inside a timed run."""
    model, cache = setup
    keys = ProposalKey.buckets(5)
    assert [k.num_rows for k in keys] == [1, 2, 4, 8] and all(k.all_greedy and not k.needs_ranking for k in keys)
    with torch.no_grad(), batch_invariant():
        graphs = DraftProposalGraphs(model, NEXTN, "rejection", use_graphs=False)
        graphs.capture(cache, keys)
        prepared = dict(graphs.static)
        for n in range(1, 6):
            rows = [row(0.0, seed=i) for i in range(n)]  # greedy, unranked, unbanned: the benchmark's
            graphs.propose(
                HostInputs.pack(rows, list(range(n)), STARTS[:n], list(range(1, n + 1)), NEXTN, V, "rejection"), cache
            )
    assert graphs.static == prepared and set(prepared) == set(keys)


def test_inputs_of_another_key_are_refused(setup):
    model, cache = setup
    host = HostInputs.pack(ROWS[:2], [1, 2], [3, 4], [1, 2], NEXTN, V, "rejection")
    static = StaticDraftProposal(
        model, cache, dataclasses.replace(ProposalKey.of(host), num_rows=8), NEXTN, "rejection"
    )
    with pytest.raises(ValueError, match="do not fit"):
        static.fill(host)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("conversion", ["moe", "all"])
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_on_cuda_the_graph_replay_equals_the_static_proposal_run_eagerly(mode, conversion):
    """The same model (its draft's MoE on KernelMoE, which a capture needs; "all": every draft module the kernel
    backend converts, its norms, mHC sites and FP8 projections too) and cache, the same buffers' values:
    replaying the captured graph gives the eager run's bits, for two batches in a row (the second replay reads
    the refilled buffers, not what the capture saw). The second fill and replay run under CUDA's sync debug
    mode "error" (the first captures, which synchronises)."""
    from services.worker.kernel_model.backend import convert_model
    from services.worker.kernel_model.kernel_set import KernelSet
    from services.worker.kernel_model.moe import KernelMoE

    torch.manual_seed(0)
    draft = DSpark(CFG).eval().cuda()
    kernels = KernelSet.compiled()
    if conversion == "all":
        convert_model(draft, "fp8", kernels)
    for stage in draft.stages:
        if not isinstance(stage.ffn, KernelMoE):
            stage.ffn = KernelMoE(stage.ffn, "fp8", kernels)
    model = types.SimpleNamespace(
        cfg=CFG,
        draft=draft,
        embed=nn.Embedding(V, CFG.hidden_size).cuda(),
        head=nn.Linear(CFG.hidden_size, V, bias=False).cuda(),
    )
    cache = CacheEngine(
        CFG, 16, num_blocks=2, num_state_slots=len(ROWS) + 1, ring=ring_size(CFG), device="cuda", draft=True
    )
    for stage in range(len(draft.stages)):
        ring = cache.draft_ring(stage)
        ring.copy_(torch.randn(ring.shape, device="cuda"))
    graphed = DraftProposalGraphs(model, NEXTN, mode, use_graphs=True)
    plain = DraftProposalGraphs(model, NEXTN, mode, use_graphs=False)
    with torch.no_grad():
        for batch, (rows, starts) in enumerate(((ROWS, STARTS), (list(reversed(ROWS[:5])), [9, 1, 0, 33, 70]))):
            b = len(rows)
            host = HostInputs.pack(rows, list(range(b)), starts, list(range(1, b + 1)), NEXTN, V, mode)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if batch else "default")
            try:
                got = graphed.propose(host, cache)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            got = [t.clone() for t in (got.drafts, got.probs, got.confidences)]
            want = plain.propose(host, cache)
            assert torch.equal(got[0], want.drafts) and torch.equal(got[1], want.probs)
            assert torch.equal(got[2], want.confidences)
    assert graphed.num_replays == 2 and len(graphed.graphs) == 1


def test_rejection_draft_distributions_land_in_their_state_slots(setup):
    """Rejection mode: the run writes each row's draft distributions at its state slot of ``slot_probs`` (what the
    next step's static verify reads), placeholders only at the null slot 0; slots that did not propose keep theirs."""
    model, cache = setup
    rows, slots = ROWS[2:5], [3, 1, 5]
    with torch.no_grad(), batch_invariant():
        graphs = DraftProposalGraphs(model, NEXTN, "rejection", use_graphs=False)
        slot_probs = graphs.slot_probs(cache)
        slot_probs.fill_(7.0)  # stale values of earlier proposals
        got = graphs.propose(HostInputs.pack(rows, [1, 2, 3], STARTS[:3], slots, NEXTN, V, "rejection"), cache)
    assert slot_probs.shape == (cache.slots.shape[0], NEXTN, V) and graphs.slot_probs(cache) is slot_probs
    for b, slot in enumerate(slots):
        assert torch.equal(slot_probs[slot], got.probs[b]), slot
    for slot in set(range(1, cache.slots.shape[0])) - set(slots):
        assert bool((slot_probs[slot] == 7.0).all()), slot
    assert (
        graphs.static[
            ProposalKey.of(HostInputs.pack(rows, [1, 2, 3], STARTS[:3], slots, NEXTN, V, "rejection"))
        ].slot_probs
        is slot_probs
    )
