"""The speculator: the worker's DSpark side. Per step it verifies each request's drafts
(services/worker/spec/verifier.py), writes the draft's context K=V of the positions the target now holds into
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
a step-cost curve where even certain drafts would not pay: none could be verified; or varlen's back-off after
proposals it verified none of, ``Scheduler::pace_proposals``), the request's context is still written but the
draft does not run for it.

A step reads the device once: every request's verification runs at once on the device, the accepted rows'
context is written there (services/worker/spec/accepted_context.py: rows the verdict rejects keep the ring's old
values), the proposal starts from the anchors the device holds, and one read brings back the verdicts with
the next drafts and confidences. With ``cuda_graphs`` the proposal replays a graph per batch bucket
(services/worker/spec/static_draft_proposal.py), and so does the verify half (the processing of the logits where
the rows fit a ``device_sampling.SamplingKey``, the verification, the context writes and the emitted rows:
services/worker/spec/static_verify.py, glued here by services/worker/spec/verify_half.py) where the step's requests fit
one; rejection mode's draft distributions stay in a per-state-slot buffer between the two graphs. The logits
are processed once: the verdicts and the step's sampler output (each row's token, logprob and top-n:
``accepted_context.emitted_output``) both read those distributions. ``timings`` keeps the host time of each
phase (services/worker/spec/timings.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from torch.profiler import record_function

from kernels.device import upload
from kernels.sampler_output import SamplerOutput
from model.batch_invariant import batch_invariant
from model.deepseek_v41.dspark import DraftContext
from model.deepseek_v41.model import DeepseekV41
from scheduler_rs import StepPlan, StepResult
from services.worker.sampling.device_sampling import SamplingKey
from services.worker.sampling.sampler import ProcessedLogits, Sampler, SamplingRow
from services.worker.spec.accepted_context import DeviceVerdict, Sampling, emitted_output, write_context
from services.worker.spec.draft_proposal import DeviceAnchors, HostInputs, Proposal, ProposalInputs, propose
from services.worker.spec.forced_acceptance import ForcedAcceptance
from services.worker.spec.static_draft_proposal import DraftProposalGraphs, ProposalKey
from services.worker.spec.static_verify import VerifyGraphs, VerifyKey
from services.worker.spec.timings import SpecTimings
from services.worker.spec.verifier import SPEC_SAMPLING
from services.worker.spec.verify_half import eager_verdict, forced_counts, static_verify
from services.worker.state.cache_engine import CacheEngine

PROPOSE_RANGES = ("draft.inputs", "draft.stages", "draft.slots")
"""Profiler ranges of a proposal: its inputs built on the host and copied; the draft's window read and
stages; the per-slot loop. The static proposal's buffer fill and replay (or eager run) are all "draft.stages"."""

RewriteDrafts = Callable[[str, int, list[int]], list[int]]
"""(request id, anchor position, the draft's tokens) → the tokens to verify next step instead (tests: random
weights accept almost no draft, so tests propose known tokens to exercise acceptance)."""


class Speculator:
    def __init__(
        self,
        model: DeepseekV41,
        num_speculative_tokens: int,
        spec_sampling: str = "rejection",
        rewrite_drafts: RewriteDrafts | None = None,
        batch_invariant: bool = False,
        forced_acceptance: ForcedAcceptance | None = None,
        cuda_graphs: bool = False,
        static_proposal: bool | None = None,
    ) -> None:
        """``batch_invariant``: the draft runs in the batch-invariant mode too (model/batch_invariant.py), so a
        request's drafts, and with rejection sampling its tokens, do not depend on its batch.
        ``forced_acceptance``: the benchmark switch (services/worker/spec/forced_acceptance.py); greedy only.
        ``cuda_graphs``: the proposal (window read, stages, slot loop) replays a CUDA graph per batch bucket
        (services/worker/spec/static_draft_proposal.py); ``static_proposal`` (default: ``cuda_graphs``) runs that
        static proposal, eagerly without graphs (CPU tests of what a graph captures)."""
        if model.draft is None:
            raise ValueError(
                "speculative decoding needs a model with a DSpark draft (num_nextn_predict_layers > 0 "
                "in its config); this one has none"
            )
        if not 1 <= num_speculative_tokens <= model.cfg.dspark_block_size:
            raise ValueError(
                f"num_speculative_tokens must be between 1 and the draft's block size "
                f"{model.cfg.dspark_block_size}, got {num_speculative_tokens}"
            )
        if spec_sampling not in SPEC_SAMPLING:
            raise ValueError(f"spec_sampling must be one of {SPEC_SAMPLING}, got {spec_sampling!r}")
        self.model = model
        self.nextn = num_speculative_tokens
        self.spec_sampling = spec_sampling
        # Per request: the position its next context entry (and its anchor) takes; its draft rings are in its
        # state slot.
        self.next_positions: dict[str, int] = {}
        self.drafts: dict[str, list[int]] = {}
        # [nextn, V] processed draft distributions (the eager proposal's; the static proposal leaves them per state
        # slot in DraftProposalGraphs.slot_probs, where the verify reads them).
        self.draft_probs: dict[str, torch.Tensor] = {}
        # Per draft, the confidence head's chance that it passes with every earlier draft (σ, multiplied
        # along the block): what varlen verification ranks drafts by.
        self.confidences: dict[str, list[float]] = {}
        self.rewrite_drafts = rewrite_drafts
        self.forced_acceptance = forced_acceptance
        self.batch_invariant = batch_invariant
        self.num_drafts_verified = 0  # real drafts checked, over the speculator's life
        self.num_drafts_accepted = 0
        self.num_proposals_skipped = (
            0  # requests' proposals the plan skipped (none could be verified; varlen's back-off)
        )
        self.timings = SpecTimings()  # host time per phase of ``step`` (the benchmark's split)
        static = cuda_graphs if static_proposal is None else static_proposal
        if cuda_graphs and not static:
            raise ValueError("cuda_graphs captures the static proposal: static_proposal=False contradicts it")
        self.draft_graphs = (
            DraftProposalGraphs(model, num_speculative_tokens, spec_sampling, cuda_graphs) if static else None
        )
        # The verify half (verification, emitted output, context writes) in a graph per bucket, with the proposal.
        # Rejection mode: the static proposal leaves each slot's draft distributions where the static verify reads.
        slot_probs = (
            self.draft_graphs.slot_probs if self.draft_graphs is not None and spec_sampling == "rejection" else None
        )
        self.verify_graphs = VerifyGraphs(model, num_speculative_tokens, cuda_graphs, slot_probs) if static else None

    @property
    def verify_mode(self) -> str:
        """The static verify's mode (services/worker/spec/static_verify.py): the benchmark's forced counts, or
        ``spec_sampling``."""
        return "forced" if self.forced_acceptance is not None else self.spec_sampling

    def capture_graphs(self, cache: CacheEngine, max_num_seqs: int, greedy_only: bool = False) -> None:
        """Builds (with ``cuda_graphs``: captures) the static proposals (without bans or bias; ``greedy_only``:
        all-greedy batches only) and verifies of every bucket up to ``max_num_seqs`` requests, so no live step of
        those keys captures."""
        if self.draft_graphs is None or self.verify_graphs is None:
            return
        keys = ProposalKey.buckets(max_num_seqs)
        self.draft_graphs.capture(
            cache, keys if greedy_only else keys + ProposalKey.buckets(max_num_seqs, all_greedy=False)
        )
        # The keys of steps whose rows ask for no ranking, ban or bias (the rest capture on first use).
        self.verify_graphs.capture(cache, VerifyKey.buckets(max_num_seqs, self.verify_mode, SamplingKey(False, 0, 0)))

    def release(self, request_id: str) -> None:
        for table in (self.next_positions, self.drafts, self.draft_probs, self.confidences):
            table.pop(request_id, None)

    def step(
        self,
        plan: StepPlan,
        rows: Sequence[SamplingRow],
        logits: torch.Tensor,
        taps: torch.Tensor,
        sampler: Sampler,
        cache: CacheEngine,
        positions: Sequence[int] | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> tuple[SamplerOutput, StepResult]:
        """rows/logits: the plan's sampled rows (``plan.sample_rows`` order); taps [plan rows, T·D]; ``cache``:
        the runner's, built with the draft's rings; ``positions``: the rows' positions after async scheduling's
        fix-up (default: the plan's); ``token_bitmask``: the structured-output mask, one row per sampled row (each
        draft row's from its grammar state after the drafts before it), applied to the target's processed
        distributions, so every emitted token obeys it (a draft the grammar refuses has probability 0 there and
        is rejected)."""
        if cache.layout.draft_stages != len(self.model.draft.stages):
            raise ValueError(
                f"the cache holds {cache.layout.draft_stages} draft rings but the draft has "
                f"{len(self.model.draft.stages)} stages: build the runner with nextn > 0"
            )
        with torch.no_grad(), batch_invariant(self.batch_invariant):
            return self._step(
                plan,
                rows,
                logits,
                taps,
                sampler,
                cache,
                list(positions) if positions is not None else plan.positions.tolist(),
                token_bitmask,
            )

    def _step(
        self,
        plan: StepPlan,
        rows: Sequence[SamplingRow],
        logits: torch.Tensor,
        taps: torch.Tensor,
        sampler: Sampler,
        cache: CacheEngine,
        positions: list[int],
        token_bitmask: torch.Tensor | None,
    ) -> tuple[SamplerOutput, StepResult]:
        timings, since = self.timings, time.perf_counter()
        timings.num_steps += 1
        row_requests = plan.row_requests.tolist()
        request_ids = list(plan.request_ids)
        num_sample_rows = plan.num_sample_rows.tolist()
        state_slots = plan.state_slots.tolist()
        propose = plan.propose_drafts.tolist()  # 0: no draft proposed now could be verified next step
        plan_rows: list[list[int]] = [[] for _ in request_ids]
        for r, i in enumerate(row_requests):
            plan_rows[i].append(r)
        since = timings.add("other", since)
        sampling: list[Sampling] = []
        start = 0
        for i, request_id in enumerate(request_ids):
            n, mine = num_sample_rows[i], plan_rows[i]
            first = positions[mine[0]] if mine else None
            if first is not None and i >= plan.num_decode_requests and self.next_positions.get(request_id) != first:
                # A prompt from its start (again, after a recompute), or resumed after a cached prefix: the
                # scheduler copied a snapshot into its state slot, whose draft rings hold the context before it.
                self.release(request_id)
                self.next_positions[request_id] = first
            if n == 0:  # a prompt chunk that is not the last: its features only
                self._append(cache, request_id, state_slots[i], taps[_rows(mine)], positions[mine[0]])
                continue
            self._check_continues(request_id, positions[mine[0]])
            sampling.append(
                Sampling(
                    i,
                    request_id,
                    slice(start, start + n),
                    mine,
                    state_slots[i],
                    positions[mine[0]],
                    self.drafts.get(request_id, [])[: n - 1],
                )
            )
            start += n
        # Ranked for top-n when any row asks for logprobs (the sampler's own choice); the distributions do not
        # depend on it.
        num_top = min(max((r.num_logprobs for r in rows), default=0), logits.shape[1])
        forced = forced_counts(self.forced_acceptance, sampling, rows)
        # The verify half in one static verify (a graph) where the step's requests fit one (not a prefill step's
        # last prompt chunk longer than the static verify's entries); it processes the logits itself where its
        # key covers the rows (device_sampling.SamplingKey), else they are processed here first.
        # A masked step's distributions are processed here (the static verify's own processing takes no mask).
        key_rows = rows if token_bitmask is None else None
        key = (
            VerifyKey.of(sampling, self.nextn, cache.layout.draft_window, self.verify_mode, key_rows, num_top > 0)
            if self.verify_graphs is not None and sampling
            else None
        )
        since = timings.add("other", since)
        processed = None
        if key is None or key.sampling is None:
            processed = sampler.process(logits, rows, rank_all=num_top > 0, token_bitmask=token_bitmask)
            since = timings.add("sample", since)
        if key is not None:
            verdict, sampled = self._static_verify(key, sampling, rows, processed, logits, taps, cache, num_top, forced)
            since = timings.add("verify", since)
        else:
            verdict = self._verify(sampling, rows, processed, forced, cache)
            if verdict is not None:
                write_context(self.model.draft, sampling, verdict, taps, cache)
            since = timings.add("verify", since)
            # Every row's token (the emitted ones; 0 elsewhere) with its logprob and top-n under the processed
            # distributions, by device ops queued before the read.
            sampled = emitted_output(processed, verdict, sampling, num_top)
            since = timings.add("sample", since)
        proposing = [r for r, s in enumerate(sampling) if propose[s.index]]
        proposal = None
        if verdict is not None:
            proposal = self._propose(sampling, proposing, verdict, rows, cache)
            since = timings.add("propose", since)
        # The step's one host read: per sampling request its error flag, accepted count and tokens, then the
        # proposal's drafts and confidences (token ids and fp32 values are exact in fp64).
        pieces = [] if verdict is None else [verdict.errors, verdict.num_accepted, verdict.tokens]
        if proposal is not None:
            pieces += [proposal.drafts, proposal.confidences]
        # One cat into an fp64 buffer: each piece converted exactly (bools, ids < 2⁵³, fp32), one op for all.
        flat = [t.flatten() for t in pieces]
        read = (
            torch.cat(flat, out=flat[0].new_empty(sum(t.numel() for t in flat), dtype=torch.float64)).tolist()
            if pieces
            else []
        )
        since = timings.add("read", since)
        num_r, width = len(sampling), 0 if verdict is None else verdict.tokens.shape[1]
        failed, accepted = read[:num_r], read[num_r : 2 * num_r]
        tokens = read[2 * num_r : 2 * num_r + num_r * width]
        drafted = read[2 * num_r + num_r * width :]
        num_tokens = [0] * len(request_ids)
        token_ids, errors = [], []
        for r, s in enumerate(sampling):
            if failed[r]:
                errors.append(s.index)
                continue
            a = int(accepted[r])
            emitted = [int(t) for t in tokens[r * width : r * width + a + 1]]
            num_tokens[s.index] = len(emitted)
            token_ids.extend(emitted)
            self.num_drafts_verified += len(s.drafts)
            self.num_drafts_accepted += a
            self.next_positions[s.request_id] = s.first + (len(s.rows) if s.num_rows == 1 else a + 1)
            for table in (self.drafts, self.draft_probs, self.confidences):
                table.pop(s.request_id, None)
            if not propose[s.index]:  # its context is written, so a later step proposes from it as usual
                self.num_proposals_skipped += 1
        num_drafts = [0] * len(request_ids)
        for b, r in enumerate(proposing):
            if not failed[r]:
                num_drafts[sampling[r].index] = self._keep(sampling[r].request_id, proposal, b, drafted)
        draft_ids: list[int] = []
        confidences: list[float] = []
        for i, request_id in enumerate(request_ids):
            draft_ids.extend(self.drafts.get(request_id, [])[: num_drafts[i]])
            confidences.extend(self.confidences.get(request_id, [])[: num_drafts[i]])
        timings.add("other", since)
        return sampled, StepResult(
            num_tokens, token_ids, num_drafts, draft_ids, errors=errors, draft_confidences=confidences
        )

    def _check_continues(self, request_id: str, first_position: int) -> None:
        next_position = self.next_positions.get(request_id, 0)
        if next_position != first_position:
            raise RuntimeError(
                f"the draft context of {request_id} holds positions up to {next_position - 1} but "
                f"the target's rows start at {first_position}"
            )

    def _append(self, cache: CacheEngine, request_id: str, slot: int, taps: torch.Tensor, first_position: int) -> None:
        """The draft's context K=V of a prompt chunk's rows (taps [N, T·D] at first_position …) into the
        request's state slot. The positions must continue the request's context exactly."""
        self._check_continues(request_id, first_position)
        draft = self.model.draft
        num = taps.shape[0]
        positions = torch.arange(first_position, first_position + num, device=taps.device).unsqueeze(0)  # [1, N]
        ctx = draft.context(taps.unsqueeze(0))  # [1, N, D]
        kv = [draft.context_kv(k, ctx, positions)[0] for k in range(len(draft.stages))]  # per stage [N, hd]
        cache.write_draft(slot, first_position, kv)
        self.next_positions[request_id] = first_position + num

    def _verify(
        self,
        sampling: list[Sampling],
        rows: Sequence[SamplingRow],
        processed: ProcessedLogits,
        forced: list[int] | None,
        cache: CacheEngine,
    ) -> DeviceVerdict | None:
        draft_probs = self.draft_probs
        if self.verify_graphs is not None and self.verify_graphs.slot_probs is not None:  # views of the slots' rows
            slot_probs = self.verify_graphs.slot_probs(cache)
            draft_probs = {s.request_id: slot_probs[s.slot] for s in sampling if s.drafts}
        return eager_verdict(sampling, rows, processed, self.spec_sampling, forced, draft_probs)

    def _static_verify(
        self,
        key: VerifyKey,
        sampling: list[Sampling],
        rows: Sequence[SamplingRow],
        processed: ProcessedLogits | None,
        logits: torch.Tensor,
        taps: torch.Tensor,
        cache: CacheEngine,
        num_top: int,
        forced: list[int] | None,
    ) -> tuple[DeviceVerdict, SamplerOutput]:
        return static_verify(
            self.verify_graphs, key, sampling, rows, processed, logits, taps, cache, num_top, forced, self.draft_probs
        )

    def _propose(
        self,
        sampling: list[Sampling],
        proposing: list[int],
        verdict: DeviceVerdict,
        rows: Sequence[SamplingRow],
        cache: CacheEngine,
    ) -> Proposal | None:
        """Drafts for the sampling requests ``proposing`` (indices into ``sampling``): one batched draft call over
        their state slots' draft rings, device work only (services/worker/spec/draft_proposal.py). Each anchor (the
        last emitted token, after the accepted drafts) is known only on the device: the host gives the position
        before any accepted draft and the rejection draws of every position the anchor can take."""
        if not proposing:
            return None
        model = self.model
        device = model.embed.weight.device
        picked = upload(torch.tensor(proposing, dtype=torch.int64), device)
        advance = verdict.num_accepted[picked]
        anchors = DeviceAnchors(verdict.tokens[picked, advance], advance)
        chosen = [sampling[r] for r in proposing]
        # The anchor's position when no draft is accepted: after a prompt chunk's rows, or the one decode row.
        base = [s.first + (len(s.rows) if s.num_rows == 1 else 1) for s in chosen]
        # The profiler ranges name the proposal's parts for services/bench/speculative/draft_proposal.py.
        with record_function(PROPOSE_RANGES[0]):
            host = HostInputs.pack(
                [rows[s.span.stop - 1] for s in chosen],
                [0] * len(chosen),
                base,
                [s.slot for s in chosen],
                self.nextn,
                model.cfg.vocab_size,
                self.spec_sampling,
                num_candidates=max(s.num_rows for s in chosen),
            )
            if self.draft_graphs is None:
                inputs = ProposalInputs.upload(host, self.spec_sampling, device, anchors)
        if self.draft_graphs is not None:  # the window read, stages and slot loop in one static proposal
            with record_function(PROPOSE_RANGES[1]):
                return self.draft_graphs.propose(host, cache, anchors)
        draft = model.draft
        with record_function(PROPOSE_RANGES[1]):
            kv, positions = cache.read_draft(inputs.state_slots, inputs.anchor_positions)
            context = DraftContext(kv, positions, inputs.anchor_positions)
            blocks = draft.blocks_from_context(context, inputs.anchor_tokens, model.embed, model.head)
        with record_function(PROPOSE_RANGES[2]):
            return propose(draft, blocks, inputs, self.nextn)

    def _keep(self, request_id: str, proposal: Proposal, b: int, read: list[float]) -> int:
        """Row ``b`` of the proposal, read back (``read``: drafts [B, nextn] then confidences, flat), as the
        request's drafts for its next step; returns how many."""
        num = proposal.drafts.shape[0] * self.nextn
        drafts = [int(t) for t in read[b * self.nextn : (b + 1) * self.nextn]]
        if self.rewrite_drafts is not None:
            drafts = list(self.rewrite_drafts(request_id, self.next_positions[request_id], drafts))[: self.nextn]
        self.drafts[request_id] = drafts
        # Only rejection sampling reads the draft's distributions; the static proposal's are in its per-slot buffer.
        if self.spec_sampling == "rejection" and self.draft_graphs is None:
            self.draft_probs[request_id] = proposal.probs[b]
        self.confidences[request_id] = read[num + b * self.nextn : num + (b + 1) * self.nextn][: len(drafts)]
        if self.forced_acceptance is not None:
            self.confidences[request_id] = self.forced_acceptance.confidences(len(drafts))
        return len(drafts)


def _rows(rows: list[int]) -> slice | list[int]:
    """A plan's rows of one request as a slice where contiguous (indexing with a list copies it to the device)."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return rows
