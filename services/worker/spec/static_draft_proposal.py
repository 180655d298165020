"""The DSpark proposal with static shapes: what a CUDA graph captures, one graph per batch-size bucket.

``StaticDraftProposal`` owns fixed-shape device buffers for G rows (a power-of-two bucket): the inputs
``HostInputs`` packs (services/worker/spec/draft_proposal.py), padded with placeholder rows, and the bans and
logit bias as fixed-capacity (row, token) lists whose padding entries point at column V, which ``process``
slices off. ``run()`` goes from those buffers to a ``Proposal`` with the same code as the eager path (the
window read of ``CacheEngine.read_draft``, ``DSpark.blocks_from_context``'s stages, ``propose``'s slot loop):
device ops on fixed shapes, no host read, so a graph replays it with the buffers' values left to each replay.

A placeholder row is greedy, unlimited, unbiased, seed 0, anchor token 0 at position 0 in the null state slot
0: its window is empty (every column before position 0, masked), it draws nothing, and every op of the
proposal is per row (the stages' projections, attention and the MoE in the batch-invariant mode, the slot
loop's pipeline), so a placeholder cannot change a real row. The host-known choices that pick the code path
(``needs_ranking``, ``all_greedy``) and the capacities are part of the graph's key (``ProposalKey``); a
placeholder row has neither a limit nor a temperature, so padding never changes them.

``DraftProposalGraphs`` keeps one ``StaticDraftProposal`` per key, fills it and replays its graph (``use_graphs``) or
runs it eagerly (CPU, tests: the code a graph captures). Graph outputs are the graph's own buffers: the
caller reads what it needs before the next replay. Rejection mode's draft distributions also go, inside the run,
to a per-state-slot buffer (``DraftProposalGraphs.slot_probs``) that the next step's static verify reads: no copy per
request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kernels.device import upload, upload_into
from model.deepseek_v41.dspark import DraftContext
from model.deepseek_v41.model import DeepseekV41
from services.worker.graphs.capture import capture_graph
from services.worker.sampling.device_sampling import MIN_CAPACITY, bucket, float32_bits, float32_of_bits
from services.worker.sampling.sampler import MASS_BITS
from services.worker.spec.draft_proposal import DeviceAnchors, HostInputs, Proposal, ProposalInputs, propose
from services.worker.state.cache_engine import CacheEngine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProposalKey:
    """What fixes a static proposal's shapes and code path."""

    num_rows: int  # G: the bucket (a power of two ≥ the batch)
    needs_ranking: bool  # the slot loop sorts (some row has a rank limit or top-p)
    all_greedy: bool  # the slot loop draws nothing
    num_bans: int  # the ban list's capacity (0: no bans)
    num_bias: int  # the bias list's capacity (0: no bias)

    @classmethod
    def of(cls, host: HostInputs) -> ProposalKey:
        bans, bias = host.bans.shape[0], host.bias_index.shape[0]
        return cls(
            bucket(host.ints.shape[0]),
            host.needs_ranking,
            host.all_greedy,
            bucket(bans, MIN_CAPACITY) if bans else 0,
            bucket(bias, MIN_CAPACITY) if bias else 0,
        )

    @classmethod
    def buckets(cls, max_rows: int, needs_ranking: bool = False, all_greedy: bool = True) -> list[ProposalKey]:
        """The keys of every bucket up to ``max_rows`` rows, without bans or bias: all a batch of up to
        ``max_rows`` such requests can ask for (fewer requests propose as they finish, in smaller buckets)."""
        return [cls(1 << i, needs_ranking, all_greedy, 0, 0) for i in range(bucket(max_rows).bit_length())]


class StaticDraftProposal:
    def __init__(
        self,
        model: DeepseekV41,
        cache: CacheEngine,
        key: ProposalKey,
        nextn: int,
        spec_sampling: str,
        slot_probs: torch.Tensor | None = None,
    ) -> None:
        """``slot_probs``: fp32 [state slots, nextn, V]; the run writes each row's draft distributions at its state
        slot there (placeholders at the null slot 0), where the next step's static verify reads them."""
        if model.draft is None:
            raise ValueError("a static proposal needs a model with a DSpark draft")
        self.model, self.cache, self.key, self.nextn = model, cache, key, nextn
        self.spec_sampling, self.slot_probs = spec_sampling, slot_probs
        g, device = key.num_rows, model.embed.weight.device
        self.vocab_size = model.cfg.vocab_size
        with_bits = spec_sampling == "rejection" and not key.all_greedy
        # One packed int64 buffer, filled by one upload: HostInputs.ints' columns [G, 8], the temperatures' float32
        # bits [G], the bans [num_bans, 2] (row, token id), the bias [num_bias, 3] (row, token id, value's float32
        # bits), then (rejection, not all greedy) the draft draws [G, nextn].
        sizes = (g * 8, g, 2 * key.num_bans, 3 * key.num_bias, g * nextn if with_bits else 0)
        self.packed = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
        ints, temperature_bits, bans, bias, bits = torch.split(self.packed, sizes)
        self.ints = ints.view(g, 8)
        self.temperature_bits = temperature_bits
        self.bans, self.bias = bans.view(-1, 2), bias.view(-1, 3)
        self.draft_bits = bits.view(g, nextn) if with_bits else None

    def placeholder_ints(self) -> list[int]:
        """A placeholder row's HostInputs.ints columns (see the module docstring)."""
        return [0, 0, 0, 0, 1, self.vocab_size, 1 << MASS_BITS, 0]

    def fill(self, host: HostInputs | None, anchors: DeviceAnchors | None = None) -> None:
        """Copy ``host``'s rows into the buffers (None: every row a placeholder); the rest are placeholders, and
        the ban and bias lists are padded with entries at token V (no effect). One host tensor, built whole, then
        one copy (pinned and non-blocking on CUDA). ``anchors``: the device's anchors of the first rows, copied
        over the host's (device copies, stream-ordered)."""
        key, g, v = self.key, self.key.num_rows, self.vocab_size
        n = 0
        ints: list[int] = []
        temperature_bits: list[int] = []
        bans: list[int] = []
        bias: list[int] = []
        if host is not None:
            if ProposalKey.of(host) != key:
                raise ValueError(f"inputs of key {ProposalKey.of(host)} do not fit the static proposal of {key}")
            # HostInputs are host tensors: ``numpy()`` views them (and refuses a device tensor), no device read.
            n = host.ints.shape[0]
            ints = host.ints.numpy().ravel().tolist()
            temperature_bits = host.temperatures.numpy().view(np.int32).tolist()
            bans = host.bans.numpy().ravel().tolist()
            bias = np.column_stack((host.bias_index.numpy(), host.bias_values.numpy().view(np.int32))).ravel().tolist()
        flat = ints + self.placeholder_ints() * (g - n) + temperature_bits + [float32_bits(1.0)] * (g - n)
        flat += bans + [0, v] * (key.num_bans - len(bans) // 2) + bias + [0, v, 0] * (key.num_bias - len(bias) // 3)
        if self.draft_bits is not None:
            if host is not None and anchors is None:
                flat += host.draft_bits[:, 0].numpy().ravel().tolist()
            else:
                flat += [0] * (n * self.nextn)
            flat += [0] * ((g - n) * self.nextn)
        upload_into(self.packed, torch.tensor(flat, dtype=torch.int64))
        if host is not None and anchors is not None:
            self.ints[:n, 0].copy_(anchors.tokens)
            self.ints[:n, 1].add_(anchors.advance)
            if self.draft_bits is not None:
                self.draft_bits[:n].copy_(anchors.pick(upload(host.draft_bits, self.draft_bits.device)))

    def run(self) -> Proposal:
        """Buffers → the proposal of all G rows (drafts [G, nextn], probs [G, nextn, V], confidences)."""
        ints, key = self.ints, self.key
        inputs = ProposalInputs(
            ints[:, 0],
            ints[:, 1],
            ints[:, 2],
            ints[:, 3],
            ints[:, 4].bool(),
            float32_of_bits(self.temperature_bits),
            ints[:, 5],
            ints[:, 6],
            ints[:, 7].bool(),
            self.spec_sampling,
            self.draft_bits,
            (self.bans[:, 0], self.bans[:, 1]) if key.num_bans else None,
            (self.bias[:, 0], self.bias[:, 1], float32_of_bits(self.bias[:, 2])) if key.num_bias else None,
            key.needs_ranking,
            key.all_greedy,
        )
        draft, model = self.model.draft, self.model
        kv, positions = self.cache.read_draft(inputs.state_slots, inputs.anchor_positions)
        blocks = draft.blocks_from_context(
            DraftContext(kv, positions, inputs.anchor_positions), inputs.anchor_tokens, model.embed, model.head
        )
        proposal = propose(draft, blocks, inputs, self.nextn)
        if self.slot_probs is not None:  # real rows have distinct slots; placeholders all write the null slot
            self.slot_probs.index_copy_(0, inputs.state_slots, proposal.probs)
        return proposal


class DraftProposalGraphs:
    """Static proposals per ``ProposalKey``, replayed from CUDA graphs (``use_graphs``) or run eagerly."""

    def __init__(self, model: DeepseekV41, nextn: int, spec_sampling: str, use_graphs: bool) -> None:
        device = model.embed.weight.device
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on CUDA, not {device}")
        self.model, self.nextn, self.spec_sampling, self.use_graphs = model, nextn, spec_sampling, use_graphs
        self.cache: CacheEngine | None = None  # the pools the static proposals read (a graph holds their tensors)
        self.static: dict[ProposalKey, StaticDraftProposal] = {}
        self.graphs: dict[ProposalKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[ProposalKey, Proposal] = {}
        self._pool: Any = None  # one memory pool shared by every draft graph (they never run at once)
        self._slot_probs: torch.Tensor | None = None  # rejection: per state slot its latest draft distributions
        self.num_replays = 0
        self.num_captures = 0  # graphs captured over its life (one per key and cache: more means re-captures)

    def slot_probs(self, cache: CacheEngine) -> torch.Tensor:
        """Rejection mode: fp32 [state slots, nextn, V] of ``cache``, each state slot's draft distributions of its
        request's latest proposal (rows of slots that proposed nothing since are stale: their drafts are not
        verified). The static proposals write it; the static verify (and the speculator's eager verify) read it."""
        if self.spec_sampling != "rejection":
            raise ValueError("only rejection sampling reads the draft's distributions")
        self._use(cache)
        if self._slot_probs is None:
            self._slot_probs = torch.zeros(
                cache.slots.shape[0],
                self.nextn,
                self.model.cfg.vocab_size,
                dtype=torch.float32,
                device=cache.slots.device,
            )
        return self._slot_probs

    def propose(self, host: HostInputs, cache: CacheEngine, anchors: DeviceAnchors | None = None) -> Proposal:
        """The first ``len(host)`` rows of the bucket's proposal (``anchors``: see ``StaticDraftProposal.fill``).
        With graphs, the tensors are views of the graph's output buffers, valid until the next replay of that key."""
        key = ProposalKey.of(host)
        static = self._static(cache, key)
        static.fill(host, anchors)
        if self.use_graphs:
            self.graphs[key].replay()
            self.num_replays += 1
            out = self.outputs[key]
        else:
            out = static.run()
        n = host.ints.shape[0]
        return Proposal(out.drafts[:n], out.probs[:n], out.confidences[:n])

    def capture(self, cache: CacheEngine, keys: list[ProposalKey]) -> None:
        """Builds the static proposals of ``keys`` now and, with graphs, captures them (largest first, so the
        smaller ones reuse its memory), so that no live step of those keys captures."""
        for key in sorted(keys, key=lambda k: k.num_rows, reverse=True):
            self._static(cache, key)

    def _static(self, cache: CacheEngine, key: ProposalKey) -> StaticDraftProposal:
        """The static proposal of ``key`` on ``cache``'s pools, built and (with graphs) captured on first use."""
        self._use(cache)
        static = self.static.get(key)
        if static is None:
            slot_probs = self.slot_probs(cache) if self.spec_sampling == "rejection" else None
            static = self.static[key] = StaticDraftProposal(
                self.model, cache, key, self.nextn, self.spec_sampling, slot_probs
            )
        if self.use_graphs and key not in self.graphs:
            self._capture(static)
        return static

    def _use(self, cache: CacheEngine) -> None:
        if cache is not self.cache:  # other pools: the captured graphs read the old ones' tensors
            self.static.clear(), self.graphs.clear(), self.outputs.clear()
            self.cache, self._slot_probs = cache, None

    def _capture(self, static: StaticDraftProposal) -> None:
        static.fill(None)  # placeholders only: the warm-up really runs, and reads only the null slot
        graph, self.outputs[static.key], self._pool = capture_graph(static.run, self._pool)
        self.graphs[static.key] = graph
        self.num_captures += 1
        log.info("captured the draft proposal graph of %s", static.key)
