"""The device-only proposal (services/worker/spec/draft_proposal.py) gives the host-driven loop's drafts, draft
distributions and confidences ``==`` (per slot ``Sampler.process`` and ``verifier.draft_tokens``, what the
speculator ran before), in both sampling modes, for every kind of sampling row, and reads nothing back."""

from __future__ import annotations

import collections
import copy
import dataclasses
import math

import pytest
import torch
from torch.overrides import TorchFunctionMode

from model.batch_invariant import batch_invariant
from model.deepseek_v41.dspark import DraftBlocks, DSpark
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.spec.draft_proposal import ProposalInputs, coupling_noise, propose
from services.worker.spec.verifier import draft_tokens, gumbel_noise
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES

CFG = DRAFT_CASES[0].cfg
V = CFG.vocab_size


def row(temperature=1.0, top_k=-1, top_p=1.0, seed=0, forced_top_k=None, banned=(), bias=(), num_logprobs=0):
    return SamplingRow(temperature, top_k, top_p, seed, 0, forced_top_k, banned, num_logprobs, None, bias)


# Greedy, plain draws, top-k, top-p, every filter at once, off-by-convention values, seeds past 2⁶³.
ROWS = [
    row(temperature=0.0),
    row(0.9, seed=7),
    row(1.3, top_k=5, seed=-3),
    row(0.7, top_p=0.8, seed=(1 << 64) - 1),
    row(1.0, forced_top_k=20, top_p=0.5, banned=(1, 2, 3), bias=((4, 2.5), (9, -1.0)), seed=123),
    row(2.0, top_k=0, seed=99, bias=((7, 4.0),), num_logprobs=3),
    row(0.0, top_k=3, banned=(0,)),
]
STARTS = [4, 17, 0, 40, 9, 63, 2]
GREEDY = [dataclasses.replace(r, temperature=0.0) for r in ROWS]  # the loop draws nothing


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    draft = DSpark(CFG)
    b, bs = len(ROWS), CFG.dspark_block_size
    logits = 3 * torch.randn(b, 1, bs, V)
    logits[5, 0, 2, 11] = math.nan  # an error row at one slot: processed as all-zero logits
    blocks = DraftBlocks([], torch.randn(b, 1, bs, CFG.hidden_size), logits)
    tokens = torch.randint(0, V, (b,))
    return draft, blocks, tokens


def host_driven(draft, blocks, tokens, nextn, mode, rows=ROWS):
    """The speculator's loop before: rows rebuilt per slot, ``Sampler.process``, ``draft_tokens``."""
    probs = []

    def choose(logits, slot):
        at = [dataclasses.replace(r, position=s + 1 + slot, num_logprobs=0) for r, s in zip(rows, STARTS)]
        p = Sampler().process(logits[:, 0], at)
        probs.append(p.probs)
        return draft_tokens(
            mode,
            p.probs,
            p.logprobs,
            [r.seed for r in at],
            [r.position for r in at],
            torch.tensor([r.temperature == 0 for r in at]),
        ).unsqueeze(1)

    drafts, heads = draft.propose(blocks, tokens.unsqueeze(1), choose)
    confidences = torch.sigmoid(heads.confidence_logits[:, 0, :nextn]).cumprod(dim=-1)
    return drafts[:, 0, :nextn], torch.stack(probs[:nextn], dim=1), confidences


class HostReads(TorchFunctionMode):
    """Counts what would read a device tensor on the host (a sync on CUDA)."""

    NAMES = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu"}

    def __init__(self):
        super().__init__()
        self.reads = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in self.NAMES:
            self.reads[func.__name__] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", [ROWS, GREEDY], ids=["mixed", "greedy"])
@pytest.mark.parametrize("nextn", [CFG.dspark_block_size, 2])
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_device_proposal_equals_the_host_driven_loop_and_reads_nothing_back(setup, mode, nextn, rows):
    draft, blocks, tokens = setup
    with torch.no_grad(), batch_invariant():
        want = host_driven(draft, blocks, tokens, nextn, mode, rows)
        inputs = ProposalInputs.build(
            rows, tokens.tolist(), STARTS, list(range(len(rows))), nextn, V, mode, torch.device("cpu")
        )
        with HostReads() as counter:
            got = propose(draft, blocks, inputs, nextn)
    assert counter.reads == {}
    assert torch.equal(got.drafts, want[0])
    assert torch.equal(got.probs, want[1])
    assert torch.equal(got.confidences, want[2])
    assert got.drafts.shape == (len(rows), nextn) and got.probs.shape == (len(rows), nextn, V)
    # The rows differ, so a proposal that ignored them (or their draws) would not match.
    assert len(set(map(tuple, got.drafts.tolist()))) > 1


def test_the_host_driven_loop_does_read_back(setup):
    """The counter sees the reads the device proposal avoids (the draw's checks in ``sample_from_bits``)."""
    draft, blocks, tokens = setup
    with torch.no_grad(), batch_invariant(), HostReads() as counter:
        host_driven(draft, blocks, tokens, 3, "rejection")
    assert counter.reads["__bool__"] > 0


def test_coupling_noise_is_the_verifiers_gumbel_noise():
    seeds = [0, 5, -1, (1 << 63) + 12345, 1 << 40]
    positions = [0, 1, 7, 1 << 33, 999]
    as_int64 = [(s & ((1 << 64) - 1)) - ((1 << 64) if s & (1 << 63) else 0) for s in seeds]
    got = coupling_noise(torch.tensor(as_int64), torch.tensor(positions), 300)
    assert torch.equal(got, gumbel_noise(seeds, positions, 300))


@pytest.mark.parametrize("bad", [row(banned=(V,)), row(bias=((V + 2, 1.0),))], ids=["banned", "logit_bias"])
def test_a_token_id_outside_the_vocabulary_is_refused(bad):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        ProposalInputs.build([bad], [0], [3], [0], 2, V, "rejection", torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("mode", ["rejection", "deterministic"])
def test_on_cuda_the_proposal_never_waits_for_the_device_and_equals_the_host_driven_loop(setup, mode):
    """CUDA's sync debug mode raises on any op that waits for the device (a read, a blocking copy)."""
    draft, blocks, tokens = setup
    draft = copy.deepcopy(draft).cuda()  # the module's CPU draft stays where it is
    blocks = DraftBlocks([], blocks.hidden.cuda(), blocks.logits.cuda())
    nextn = CFG.dspark_block_size
    with torch.no_grad():
        want = host_driven(draft, blocks, tokens.cuda(), nextn, mode)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            inputs = ProposalInputs.build(
                ROWS, tokens.tolist(), STARTS, list(range(len(ROWS))), nextn, V, mode, torch.device("cuda")
            )
            got = propose(draft, blocks, inputs, nextn)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # Row-wise ops on the same rows (sorting and softmax per row), so the bits match on the device too.
    assert torch.equal(got.drafts, want[0]) and torch.equal(got.probs, want[1])
    assert torch.equal(got.confidences, want[2])
