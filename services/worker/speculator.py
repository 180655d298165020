"""The speculator: the worker's DSpark side. Per step it verifies each request's drafts
(services/worker/verifier.py), writes the draft's context K=V of the positions the target now holds into
the request's state slot (``CacheEngine.write_draft``: the draft's rings live in the state-slot pool, so
the scheduler's slot accounting covers them and a freed slot frees them), and proposes the request's next
drafts with the DSpark draft.

Per request, between steps: the draft rings of its state slot hold the context K=V of every position
before its newest token (the anchor), ``next_positions[id]`` is the anchor's position; ``drafts[id]`` are
the drafts proposed for the anchor's next positions, which the scheduler feeds back as the inputs of the
request's next rows (row 0: the anchor, row j: draft j − 1), with their processed draft distributions
(``draft_probs[id]``, what rejection sampling reads) and their confidences (what varlen ranks).

A decode request has 1 + k rows (k ≤ nextn: fixed, or what varlen chose); row j is the target's
distribution for position P + j (P = the position after the anchor) and its input sits at P − 1 + j.
After verification accepts a drafts, the request emits a + 1 tokens; rows 0 … a had inputs the target
accepts, so their features enter the context (positions P − 1 … P − 1 + a), the new anchor is the last
emitted token at P + a, and the draft proposes from there. A prompt chunk's rows all enter the context;
its last chunk samples row 0 (no drafts yet) and proposes. Rejected rows' features never enter the
context, so the draft's rings need no backtracking room. Where the plan's ``propose_drafts`` is 0 (varlen on
a step-cost curve where even certain drafts would not pay: none could be verified), the request's context is
still written but the draft does not run for it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
from torch.profiler import record_function

from kernels.sampler_output import SamplerOutput
from model.batch_invariant import batch_invariant
from model.deepseek_v41.dspark import DraftContext
from model.deepseek_v41.model import DeepseekV41
from scheduler_rs import StepPlan, StepResult
from services.worker.cache_engine import CacheEngine
from services.worker.draft_proposal import HostInputs, ProposalInputs, propose
from services.worker.forced_acceptance import ForcedAcceptance
from services.worker.sampler import Sampler, SamplingRow
from services.worker.static_draft_proposal import DraftGraphs
from services.worker.verifier import SPEC_SAMPLING, verify_deterministic, verify_rejection


PROPOSE_RANGES = ("draft.inputs", "draft.stages", "draft.slots")
"""Profiler ranges of a proposal: its inputs built on the host and copied; the draft's window read and
stages; the per-slot loop."""

RewriteDrafts = Callable[[str, int, list[int]], list[int]]
"""(request id, anchor position, the draft's tokens) → the tokens to verify next step instead (tests: random
weights accept almost no draft, so tests propose known tokens to exercise acceptance)."""


class Speculator:
    def __init__(self, model: DeepseekV41, num_speculative_tokens: int, spec_sampling: str = "rejection",
                 rewrite_drafts: RewriteDrafts | None = None, batch_invariant: bool = False,
                 forced_acceptance: ForcedAcceptance | None = None, cuda_graphs: bool = False,
                 static_proposal: bool | None = None) -> None:
        """``batch_invariant``: the draft runs in the batch-invariant mode too (model/batch_invariant.py), so a
        request's drafts, and with rejection sampling its tokens, do not depend on its batch.
        ``forced_acceptance``: the benchmark switch (services/worker/forced_acceptance.py); greedy only.
        ``cuda_graphs``: the proposal (window read, stages, slot loop) replays a CUDA graph per batch bucket
        (services/worker/static_draft_proposal.py); ``static_proposal`` (default: ``cuda_graphs``) runs that
        static proposal, eagerly without graphs (CPU tests of what a graph captures)."""
        if model.draft is None:
            raise ValueError("speculative decoding needs a model with a DSpark draft (num_nextn_predict_layers > 0 "
                             "in its config); this one has none")
        if not 1 <= num_speculative_tokens <= model.cfg.dspark_block_size:
            raise ValueError(f"num_speculative_tokens must be between 1 and the draft's block size "
                             f"{model.cfg.dspark_block_size}, got {num_speculative_tokens}")
        if spec_sampling not in SPEC_SAMPLING:
            raise ValueError(f"spec_sampling must be one of {SPEC_SAMPLING}, got {spec_sampling!r}")
        self.model = model
        self.nextn = num_speculative_tokens
        self.spec_sampling = spec_sampling
        # Per request: the position its next context entry (and its anchor) takes; its draft rings are in its
        # state slot.
        self.next_positions: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}
        self.draft_probs: dict[str, torch.Tensor] = {}  # [nextn, V] processed draft distributions
        # Per draft, the confidence head's chance that it passes with every earlier draft (σ, multiplied
        # along the block): what varlen verification ranks drafts by.
        self.confidences: dict[str, list[float]] = {}
        self.rewrite_drafts = rewrite_drafts
        self.forced_acceptance = forced_acceptance
        self.batch_invariant = batch_invariant
        self.num_drafts_verified = 0  # real drafts checked, over the speculator's life
        self.num_drafts_accepted = 0
        self.num_proposals_skipped = 0  # requests' proposals the plan said no step could verify
        static = cuda_graphs if static_proposal is None else static_proposal
        if cuda_graphs and not static:
            raise ValueError("cuda_graphs captures the static proposal: static_proposal=False contradicts it")
        self.draft_graphs = (DraftGraphs(model, num_speculative_tokens, spec_sampling, cuda_graphs) if static
                             else None)

    def release(self, request_id: str) -> None:
        for table in (self.next_positions, self.drafts, self.draft_probs, self.confidences):
            table.pop(request_id, None)

    def step(self, plan: StepPlan, rows: Sequence[SamplingRow], logits: torch.Tensor, taps: torch.Tensor,
             sampler: Sampler, cache: CacheEngine, positions: Sequence[int] | None = None
             ) -> tuple[SamplerOutput, StepResult]:
        """rows/logits: the plan's sampled rows (``plan.sample_rows`` order); taps [plan rows, T·D]; ``cache``:
        the runner's, built with the draft's rings; ``positions``: the rows' positions after async scheduling's
        fix-up (default: the plan's)."""
        if cache.layout.draft_stages != len(self.model.draft.stages):
            raise ValueError(f"the cache holds {cache.layout.draft_stages} draft rings but the draft has "
                             f"{len(self.model.draft.stages)} stages: build the runner with nextn > 0")
        with torch.no_grad(), batch_invariant(self.batch_invariant):
            return self._step(plan, rows, logits, taps, sampler, cache,
                              list(positions) if positions is not None else plan.positions.tolist())

    def _step(self, plan: StepPlan, rows: Sequence[SamplingRow], logits: torch.Tensor, taps: torch.Tensor,
              sampler: Sampler, cache: CacheEngine, positions: list[int]) -> tuple[SamplerOutput, StepResult]:
        row_requests = plan.row_requests.tolist()
        request_ids = list(plan.request_ids)
        num_sample_rows = plan.num_sample_rows.tolist()
        state_slots = plan.state_slots.tolist()
        propose = plan.propose_drafts.tolist()  # 0: no draft proposed now could be verified next step
        plan_rows: list[list[int]] = [[] for _ in request_ids]
        for r, i in enumerate(row_requests):
            plan_rows[i].append(r)
        processed = sampler.process(logits, rows)
        chosen = [0] * len(rows)  # the token every sampled row reports (emitted or not)
        num_tokens, token_ids, errors, anchors = [], [], [], []
        start = 0
        for i, request_id in enumerate(request_ids):
            n = num_sample_rows[i]
            mine = plan_rows[i]
            if mine and positions[mine[0]] == 0:  # a prompt from its start (again, after a recompute)
                self.release(request_id)
            slot = state_slots[i]
            if n == 0:  # a prompt chunk that is not the last: its features only
                self._append(cache, request_id, slot, taps[mine], positions[mine[0]])
                num_tokens.append(0)
                continue
            span = slice(start, start + n)
            start += n
            if bool(processed.errors[span].any()):
                errors.append(i)
                num_tokens.append(0)
                continue
            emitted = self._verify(request_id, rows[span], processed.probs[span], processed.logprobs[span])
            chosen[span.start : span.start + len(emitted)] = emitted
            accepted_rows = mine[: len(emitted)] if n > 1 else mine  # decode: rows 0 … a; prefill: the chunk
            self._append(cache, request_id, slot, taps[accepted_rows], positions[accepted_rows[0]])
            num_tokens.append(len(emitted))
            token_ids.extend(emitted)
            if propose[i]:
                anchors.append((i, request_id, emitted[-1], rows[span.stop - 1], slot))
            else:  # its context is written (above), so a later step proposes from it as usual
                self.num_proposals_skipped += 1
                for table in (self.drafts, self.draft_probs, self.confidences):
                    table.pop(request_id, None)
        num_drafts = [0] * len(request_ids)
        draft_ids: list[int] = []
        confidences: list[float] = []
        for i, drafts in self._propose(anchors, cache):
            num_drafts[i] = len(drafts)
        for i, request_id in enumerate(request_ids):
            draft_ids.extend(self.drafts.get(request_id, [])[: num_drafts[i]])
            confidences.extend(self.confidences.get(request_id, [])[: num_drafts[i]])
        forced = [dataclasses.replace(row, forced_token_id=t) for row, t in zip(rows, chosen)]
        sampled = sampler(logits, forced)  # logprobs and top-n of each row's token, under its processed distribution
        return sampled, StepResult(num_tokens, token_ids, num_drafts, draft_ids, errors=errors,
                                   draft_confidences=confidences)

    def _append(self, cache: CacheEngine, request_id: str, slot: int, taps: torch.Tensor, first_position: int
                ) -> None:
        """The draft's context K=V of the target's accepted rows (taps [N, T·D] at first_position …) into the
        request's state slot. The positions must continue the request's context exactly."""
        next_position = self.next_positions.get(request_id, 0)
        if next_position != first_position:
            raise RuntimeError(f"the draft context of {request_id} holds positions up to {next_position - 1} but "
                               f"the target's rows start at {first_position}")
        draft = self.model.draft
        num = taps.shape[0]
        positions = torch.arange(first_position, first_position + num, device=taps.device).unsqueeze(0)  # [1, N]
        ctx = draft.context(taps.unsqueeze(0))  # [1, N, D]
        kv = [draft.context_kv(k, ctx, positions)[0] for k in range(len(draft.stages))]  # per stage [N, hd]
        cache.write_draft(slot, first_position, kv)
        self.next_positions[request_id] = first_position + num

    def _verify(self, request_id: str, rows: Sequence[SamplingRow], probs: torch.Tensor, logprobs: torch.Tensor
                ) -> list[int]:
        """One request's emitted tokens: its accepted drafts, then the target's token."""
        drafts = self.drafts.pop(request_id, [])[: len(rows) - 1]
        k = len(rows) - 1
        device = probs.device
        padded = torch.tensor(drafts + [0] * (k - len(drafts)), dtype=torch.int64, device=device).view(1, k)
        greedy = torch.tensor([rows[0].temperature == 0], device=device)
        seeds, first = [rows[0].seed], [rows[0].position]
        if self.spec_sampling == "rejection":
            q = self.draft_probs.pop(request_id, None)
            q = torch.zeros(k, probs.shape[-1], device=device) if q is None else q[:k]
            v = verify_rejection(probs.unsqueeze(0), q.unsqueeze(0), padded, seeds, first, greedy, [len(drafts)])
        else:
            v = verify_deterministic(logprobs.unsqueeze(0), padded, seeds, first, greedy, [len(drafts)])
        self.num_drafts_verified += len(drafts)
        if self.forced_acceptance is not None:  # the benchmark's verdict replaces the verifier's
            if not bool(greedy[0]):
                raise ValueError("forced acceptance (a benchmark switch) runs greedy requests only (temperature 0)")
            m = self.forced_acceptance.num_accepted(len(drafts))
            self.num_drafts_accepted += m
            return drafts[:m] + [int(probs[m].argmax())]
        self.num_drafts_accepted += int(v.num_accepted[0])
        return v.tokens[0, : int(v.num_accepted[0]) + 1].tolist()

    def _propose(self, anchors: list[tuple[int, str, int, SamplingRow, int]], cache: CacheEngine
                 ) -> list[tuple[int, list[int]]]:
        """Drafts for every request that emitted tokens: one batched draft call over their state slots' draft
        rings, device work only (services/worker/draft_proposal.py) but for one read of the drafts and
        confidences. anchors: (request index, id, anchor token, its last sampling row, state slot). Returns
        (request index, drafts)."""
        if not anchors:
            return []
        draft, model = self.model.draft, self.model
        starts = [self.next_positions[request_id] for _, request_id, _, _, _ in anchors]  # the anchors' positions
        # The profiler ranges name the proposal's parts for services/bench/draft_proposal.py.
        with record_function(PROPOSE_RANGES[0]):
            host = HostInputs.pack([row for *_, row, _ in anchors], [t for _, _, t, _, _ in anchors], starts,
                                   [slot for *_, slot in anchors], self.nextn, model.cfg.vocab_size, self.spec_sampling)
            if self.draft_graphs is None:
                inputs = ProposalInputs.upload(host, self.spec_sampling, model.embed.weight.device)
        if self.draft_graphs is not None:  # the window read, stages and slot loop in one static proposal
            with record_function(PROPOSE_RANGES[1]):
                proposal = self.draft_graphs.propose(host, cache)
        else:
            with record_function(PROPOSE_RANGES[1]):
                kv, positions = cache.read_draft(inputs.state_slots, inputs.anchor_positions)
                context = DraftContext(kv, positions, inputs.anchor_positions)
                blocks = draft.blocks_from_context(context, inputs.anchor_tokens, model.embed, model.head)
            with record_function(PROPOSE_RANGES[2]):
                proposal = propose(draft, blocks, inputs, self.nextn)
        # Only rejection sampling reads the draft's distributions; a graph's are its output buffers, which the
        # next replay overwrites, so they are copied.
        probs = None
        if self.spec_sampling == "rejection":
            probs = proposal.probs.clone() if self.draft_graphs is not None else proposal.probs
        # The proposal's one host read: drafts and confidences together (token ids and fp32 values are exact
        # in fp64).
        read = torch.cat((proposal.drafts.to(torch.float64), proposal.confidences.to(torch.float64)), dim=1).tolist()
        out = []
        for b, (i, request_id, _, _, _) in enumerate(anchors):
            self.drafts[request_id] = [int(t) for t in read[b][: self.nextn]]
            if self.rewrite_drafts is not None:
                rewritten = self.rewrite_drafts(request_id, starts[b], self.drafts[request_id])
                self.drafts[request_id] = list(rewritten)[: self.nextn]
            if probs is not None:
                self.draft_probs[request_id] = probs[b]
            self.confidences[request_id] = read[b][self.nextn :][: len(self.drafts[request_id])]
            if self.forced_acceptance is not None:
                self.confidences[request_id] = self.forced_acceptance.confidences(len(self.drafts[request_id]))
            out.append((i, self.drafts[request_id]))
        return out
