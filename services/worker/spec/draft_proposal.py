"""The DSpark draft's proposal as device work only: after the stages, the per-slot loop (the head, the Markov
head, the sampling pipeline, the draw keyed by (seed, position), the confidences) on fixed-shape tensors,
with no read of a device tensor on the host.

Everything that depends on the host (the rows' sampling parameters, the rejection mode's draft draws) is
known before the draft runs, so ``HostInputs.pack`` packs it once per proposal into a few host tensors that
reach the device in one non-blocking copy each (pinned on CUDA); the loop reads only those. The anchors may
come from the device instead (``DeviceAnchors``: the token after the drafts the step accepted, known only
there), with the draws drawn for every position the anchor can take. What comes back (``Proposal``) stays
on the device; the speculator reads drafts and confidences once, in the step's one read. The static
proposal (services/worker/spec/static_draft_proposal.py) runs this same code on fixed-shape buffers.

Invariant (tested ``==`` in the batch-invariant mode): for the same blocks, anchors and rows, the drafts,
their processed distributions and the confidences equal the host-driven path's (``Sampler.process`` and
``verifier.draft_tokens`` per slot), in both ``spec_sampling`` modes:

- the slot's processing is ``device_sampling``'s (``Sampler.process`` with every row treated alike: a row
  without a rank limit gets the limit V, a row without top-p keeps its logits; every op is per row, so a
  row's values do not depend on which other rows share the call), run as ``scale`` then only the softmaxes
  the draw reads: the probs always, the logprobs in deterministic mode only; no masked copy of the banned
  logits, which no slot reads; no division where every row is greedy (every temperature 1).
- rejection: the draft's bits at (seed + DRAFT_SEED_OFFSET, position) are ``draw_bits``'s own, drawn on the
  host for every slot at once; ``pick_from_bits`` is ``sample_from_bits`` less its checks, which a softmax
  output always passes.
- deterministic: the Gumbel noise is ``verifier.coupling_noise``, ``draw_bits_per_token``'s counter layout
  (kernels/philox.py) on device positions (its host-side position check is replaced by the caller's
  positions, all ≥ 0 here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.device import upload
from kernels.philox import DrawCase, draw_bits
from model.deepseek_v41.dspark import DraftBlocks, DSpark
from services.worker.sampling.device_sampling import DeviceSampling, scale
from services.worker.sampling.sampler import MASS_BITS, SamplingRow, pick_from_bits
from services.worker.spec.verifier import DRAFT_SEED_OFFSET, SPEC_SAMPLING, coupling_noise


@dataclass(frozen=True)
class Proposal:
    """B requests' drafts, on the device."""

    drafts: torch.Tensor  # int64 [B, nextn]: draft j is the token proposed for anchor position + 1 + j
    probs: torch.Tensor  # fp32 [B, nextn, V]: the processed draft distribution each draft came from
    confidences: torch.Tensor  # fp32 [B, nextn]: σ(confidence logit) multiplied along the block (non-increasing)


@dataclass(frozen=True)
class ProposalInputs:
    """The host side of one proposal, on the device. One row per request."""

    anchor_tokens: torch.Tensor  # int64 [B]: the last emitted token, the block's slot-0 input
    anchor_positions: torch.Tensor  # int64 [B]: the anchor's position (slot j drafts position + 1 + j)
    state_slots: torch.Tensor  # int64 [B]: the request's state slot (its draft rings)
    seeds: torch.Tensor  # int64 [B]: the row's seed mod 2⁶⁴, two's complement
    greedy: torch.Tensor  # bool [B]: temperature 0 (argmax, ties to the lowest id)
    temperatures: torch.Tensor  # fp32 [B]: the pipeline's divisor (1 for greedy, ≥ float32 tiny otherwise)
    rank_limits: torch.Tensor  # int64 [B]: tokens the top-k and forced top-k keep (V: no limit)
    top_p_limits: torch.Tensor  # int64 [B]: ceil(top_p · 2³¹), the mass before a kept token stays below it
    nucleus: torch.Tensor  # bool [B]: top_p < 1 (only these rows apply the top-p mask)
    spec_sampling: str  # "rejection": the draft draws with its own key; "deterministic": the coupled noise
    draft_bits: torch.Tensor | None  # int64 [B, nextn]: rejection mode's draft draws; None: deterministic or all greedy
    bans: tuple[torch.Tensor, torch.Tensor] | None  # (row, token id) int64 [M] each, set to −inf (token id V:
    #                                                  a padding entry, no effect); None: none
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token id, fp32 value) [L] (token id V:
    #                                                               padding); None: none
    needs_ranking: bool  # some row has a rank limit or top-p, so the loop sorts (host-known, fixed per batch)
    all_greedy: bool  # every row is greedy, so the loop draws nothing (host-known, fixed per batch)

    @classmethod
    def build(
        cls,
        rows: Sequence[SamplingRow],
        anchor_tokens: Sequence[int],
        anchor_positions: Sequence[int],
        state_slots: Sequence[int],
        nextn: int,
        vocab_size: int,
        spec_sampling: str,
        device: torch.device,
    ) -> ProposalInputs:
        """From host data only: per request its last sampling row, anchor token and position, state slot."""
        host = HostInputs.pack(rows, anchor_tokens, anchor_positions, state_slots, nextn, vocab_size, spec_sampling)
        return cls.upload(host, spec_sampling, device)

    @classmethod
    def upload(
        cls, host: HostInputs, spec_sampling: str, device: torch.device, anchors: DeviceAnchors | None = None
    ) -> ProposalInputs:
        """``host``'s tensors on ``device``, one non-blocking copy each (pinned on CUDA); ``anchors``: the
        anchors known only on the device, replacing the host's tokens and advancing its positions."""
        ints, temperatures = _to_device(host.ints, device), _to_device(host.temperatures, device)
        draft_bits = None if host.draft_bits is None else _to_device(host.draft_bits, device)
        anchor_tokens, anchor_positions = ints[:, 0], ints[:, 1]
        if anchors is not None:
            anchor_tokens, anchor_positions = anchors.tokens, anchor_positions + anchors.advance
        if draft_bits is not None:
            draft_bits = draft_bits[:, 0] if anchors is None else anchors.pick(draft_bits)
        bans = None if host.bans.shape[0] == 0 else _to_device(host.bans, device)
        bias = (
            None
            if host.bias_index.shape[0] == 0
            else (_to_device(host.bias_index, device), _to_device(host.bias_values, device))
        )
        return cls(
            anchor_tokens,
            anchor_positions,
            ints[:, 2],
            ints[:, 3],
            ints[:, 4].bool(),
            temperatures,
            ints[:, 5],
            ints[:, 6],
            ints[:, 7].bool(),
            spec_sampling,
            draft_bits,
            None if bans is None else (bans[:, 0], bans[:, 1]),
            None if bias is None else (bias[0][:, 0], bias[0][:, 1], bias[1]),
            host.needs_ranking,
            host.all_greedy,
        )


@dataclass(frozen=True)
class DeviceAnchors:
    """Anchors that depend on the step's verification, on the device (so the host need not read it first)."""

    tokens: torch.Tensor  # int64 [B]: the anchor tokens (the last emitted tokens)
    advance: torch.Tensor  # int64 [B] in [0, C): the anchor sits this many positions after the host's anchor position

    def pick(self, candidates: torch.Tensor) -> torch.Tensor:
        """The rejection draws of each row's anchor: candidates int64 [B, C, nextn] → [B, nextn]."""
        index = self.advance.view(-1, 1, 1).expand(-1, 1, candidates.shape[2])
        return candidates.gather(1, index)[:, 0]


@dataclass(frozen=True)
class HostInputs:
    """``ProposalInputs`` on the host, before the copy: what the eager path uploads as is and the static
    proposal (services/worker/spec/static_draft_proposal.py) copies into its fixed-shape buffers."""

    ints: torch.Tensor  # int64 [B, 8]: anchor token, anchor position, state slot, seed, greedy, rank limit,
    #                     top-p mass limit, nucleus (ProposalInputs' fields of the same names, in this order)
    temperatures: torch.Tensor  # fp32 [B]
    draft_bits: torch.Tensor | None  # int64 [B, C, nextn]: the draws for an anchor at anchor position + c (C
    #                                  candidates: the anchor can advance by what the device accepts); None:
    #                                  deterministic mode or every row greedy
    bans: torch.Tensor  # int64 [M, 2]: (row, token id), set to −inf
    bias_index: torch.Tensor  # int64 [L, 2]: (row, token id)
    bias_values: torch.Tensor  # fp32 [L]: added to the logit there
    needs_ranking: bool  # some row has a rank limit or top-p
    all_greedy: bool  # every row is greedy

    @classmethod
    def pack(
        cls,
        rows: Sequence[SamplingRow],
        anchor_tokens: Sequence[int],
        anchor_positions: Sequence[int],
        state_slots: Sequence[int],
        nextn: int,
        vocab_size: int,
        spec_sampling: str,
        num_candidates: int = 1,
    ) -> HostInputs:
        """``num_candidates``: C, the anchor positions each row's draws are drawn for (see ``draft_bits``)."""
        if spec_sampling not in SPEC_SAMPLING:
            raise ValueError(f"spec_sampling must be one of {SPEC_SAMPLING}, got {spec_sampling!r}")
        b = len(rows)
        seeds = [(r.seed & ((1 << 64) - 1)) - ((1 << 64) if r.seed & (1 << 63) else 0) for r in rows]
        tiny = torch.finfo(torch.float32).tiny
        ints = torch.tensor(
            [
                [
                    t,
                    p,
                    slot,
                    s,
                    int(r.temperature == 0),
                    r.rank_limit if r.rank_limit is not None else vocab_size,
                    math.ceil(r.top_p * (1 << MASS_BITS)),
                    int(r.top_p < 1),
                ]
                for r, t, p, slot, s in zip(rows, anchor_tokens, anchor_positions, state_slots, seeds)
            ],
            dtype=torch.int64,
        ).view(b, 8)
        temperatures = torch.tensor(
            [max(r.temperature, tiny) if r.temperature > 0 else 1.0 for r in rows], dtype=torch.float32
        )
        all_greedy = all(r.temperature == 0 for r in rows)
        draft_bits = None
        if spec_sampling == "rejection" and not all_greedy:
            c = num_candidates
            keys = [(r.seed + DRAFT_SEED_OFFSET) % (1 << 64) for r in rows for _ in range(c * nextn)]
            positions = [p + a + 1 + j for p in anchor_positions for a in range(c) for j in range(nextn)]
            draft_bits = draw_bits(keys, positions, DrawCase.SAMPLE, "cpu").view(b, c, nextn)
        bans = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
        bias = [(i, t, v) for i, r in enumerate(rows) for t, v in r.logit_bias]
        for kind, entries in (("banned", bans), ("logit_bias", bias)):
            for i, t, *_ in entries:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"row {i}: {kind} token id {t} is outside the vocabulary [0, {vocab_size})")
        needs_ranking = any(r.rank_limit is not None or r.top_p < 1 for r in rows)
        return cls(
            ints,
            temperatures,
            draft_bits,
            torch.tensor(bans, dtype=torch.int64).view(-1, 2),
            torch.tensor([(i, t) for i, t, _ in bias], dtype=torch.int64).view(-1, 2),
            torch.tensor([v for *_, v in bias], dtype=torch.float32),
            needs_ranking,
            all_greedy,
        )


_to_device = upload  # a host tensor's copy on the device without waiting for the device


def sampling(inputs: ProposalInputs) -> DeviceSampling:
    """The rows' sampling parameters as ``device_sampling`` takes them (views only: built once per proposal)."""
    return DeviceSampling(
        inputs.temperatures,
        inputs.rank_limits,
        inputs.top_p_limits,
        inputs.nucleus,
        inputs.bans,
        inputs.bias,
        inputs.needs_ranking,
        unit_temperatures=inputs.all_greedy,
    )


def propose(draft: DSpark, blocks: DraftBlocks, inputs: ProposalInputs, nextn: int) -> Proposal:
    """Drafts for one block per request: blocks from ``DSpark.blocks_from_context`` (A = 1) at the inputs'
    anchors; ``nextn`` ≤ the block size slots."""
    probs: list[torch.Tensor] = []
    rows = sampling(inputs)

    def choose(logits: torch.Tensor, slot: int) -> torch.Tensor:  # logits [B, 1, V] → tokens [B, 1]
        scaled = scale(logits[:, 0], rows, keep_banned=False).scaled
        p = torch.softmax(scaled, dim=-1)  # process's probs; its logprobs only where the deterministic draw reads them
        probs.append(p)
        if inputs.all_greedy:  # each mode's argmax, as below
            picked = (p if inputs.spec_sampling == "rejection" else torch.log_softmax(scaled, dim=-1)).argmax(-1)
        elif inputs.draft_bits is not None:  # rejection: the draft's own key
            drawn = pick_from_bits(p, inputs.draft_bits[:, slot])
            picked = torch.where(inputs.greedy, p.argmax(-1), drawn)
        else:  # deterministic: the target's noise at the same position
            logp = torch.log_softmax(scaled, dim=-1)
            noise = coupling_noise(inputs.seeds, inputs.anchor_positions + 1 + slot, logp.shape[-1])
            picked = torch.where(inputs.greedy, logp.argmax(-1), (logp.to(torch.float64) + noise).argmax(-1))
        return picked.unsqueeze(1)

    drafts, heads = draft.propose(blocks, inputs.anchor_tokens.unsqueeze(1), choose, num_slots=nextn)  # [B, 1, nextn]
    confidences = torch.sigmoid(heads.confidence_logits[:, 0, :nextn]).cumprod(dim=-1)
    return Proposal(drafts[:, 0, :nextn], torch.stack(probs, dim=1), confidences)
