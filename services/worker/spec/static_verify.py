"""A speculative step's verify half with static shapes: what a CUDA graph captures, one graph per bucket.

``StaticVerify`` owns fixed-shape device buffers for R requests (a power-of-two bucket) of up to 1 + nextn
sampled rows and M = bucket(1 + nextn) context entries each (a decode request's rows; a last prompt chunk
writes its last min(rows, W), which fits only where W ≤ M: a step with a longer one, a prefill step, takes
the eager path, as the runner does), and ``run()`` goes from them to what the step reads back and what
the proposal starts from: the verification (services/worker/spec/verifier.py's ``rejection_verdict`` or
``deterministic_verdict``, or the benchmark's forced counts), every sampled row's emitted token and its
logprob (``accepted_context.emitted_output``'s values), and the draft's context K=V of the accepted rows
written into the state slots' rings (``accepted_context.write_context``'s writes). The buffers are filled
by one packed int64 upload plus device copies of the step's processed distributions, taps and (rejection)
draft distributions. Where the key has a ``SamplingKey`` (services/worker/sampling/device_sampling.py), the upload also
holds the rows' sampling parameters, the fill copies the step's logits instead, and the run processes them
(``device_sampling.process``, ``==`` ``Sampler.process``); where it is built with ``slot_probs``, rejection
reads the draft distributions from the static proposal's per-state-slot buffer by each request's slot; ``run`` reads
nothing on the host, indexes with no boolean mask and writes no Python scalar into a device tensor, so a graph
replays it with the buffers' values left to each replay.

Layout: request r verifies width = 1 + nextn columns (its rows past its own repeat its last row, its drafts
past its own are not verified: the eager path's padding, on a fixed width); its context entries are the
rows the eager ``write_context`` computes (a decode request's rows, a last prompt chunk's last W), at
entry e ↔ row offset j0 + e. A placeholder request samples no row, has no entry and sits in the null state
slot 0: its entries write the ring's old values of slot 0 back (all of them the same value, so their
collisions are harmless), and its sampled-row writes go to a dump row past the buffers. Every op is per
request, per row or per entry, so a placeholder cannot change a real request's values.

``VerifyGraphs`` keeps one ``StaticVerify`` per ``VerifyKey`` and replays its graph (``use_graphs``) or runs
it eagerly (CPU, tests: the code a graph captures). Outputs are the graph's buffers, valid until the next
replay of that key.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kernels.device import upload_into
from kernels.philox import DrawCase
from model.deepseek_v41.model import DeepseekV41
from services.worker.graphs.capture import capture_graph
from services.worker.sampling.device_sampling import SamplingKey, bucket, process
from services.worker.sampling.sampler import ProcessedLogits, SamplingRow
from services.worker.spec.accepted_context import DeviceVerdict, Sampling
from services.worker.spec.verifier import (
    SPEC_SAMPLING,
    deterministic_verdict,
    device_draws,
    rejection_verdict,
    signed_seed,
)
from services.worker.state.cache_engine import CacheEngine

log = logging.getLogger(__name__)

MODES = SPEC_SAMPLING + ("forced",)
"""The verdict's source: a verifier mode, or the benchmark's forced acceptance counts."""

# Columns of a request's row in the packed table (placeholder values in ``_PLACEHOLDER``).
START, NUM_ROWS, NUM_DRAFTS, SEED, GREEDY, POSITION, SLOT, FIRST, WHOLE, NUM_ENTRIES, J0, FORCED = range(12)
NUM_COLUMNS = 12  # then the drafts, nextn columns
_PLACEHOLDER = (0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0)


def num_entries(nextn: int) -> int:
    """M: the context entries a static verify holds per request."""
    return bucket(1 + nextn)


@dataclass(frozen=True)
class VerifyKey:
    """What fixes a static verify's shapes and code path."""

    num_requests: int  # R: the bucket (a power of two ≥ the sampling requests)
    mode: str  # one of MODES
    sampling: SamplingKey | None = None  # the rows' processing inside the run (device_sampling.py); None: the
    #                                      step's processed distributions are copied in

    @classmethod
    def of(
        cls,
        sampling: Sequence[Sampling],
        nextn: int,
        window: int,
        mode: str,
        rows: Sequence[SamplingRow] | None = None,
        rank_all: bool = False,
    ) -> VerifyKey | None:
        """The key of a step's sampling requests; None where one writes more entries than M (the eager path).
        With ``rows`` (the step's sampling rows; ``rank_all``: the step wants top-n), the run processes them
        where ``SamplingKey.of`` covers them."""
        if any(len(_entries(s, window)) > num_entries(nextn) for s in sampling):
            return None
        return cls(bucket(len(sampling)), mode, None if rows is None else SamplingKey.of(rows, rank_all))

    @classmethod
    def buckets(cls, max_requests: int, mode: str, sampling: SamplingKey | None = None) -> list[VerifyKey]:
        """Every key a batch of up to ``max_requests`` can ask for."""
        return [cls(1 << i, mode, sampling) for i in range(bucket(max_requests).bit_length())]


def _entries(s: Sampling, window: int) -> range:
    """The request's row offsets whose context the step writes (the eager ``write_context``'s)."""
    if s.num_rows == 1:  # every row accepted: only the last W can ever be read
        return range(max(len(s.rows) - window, 0), len(s.rows))
    return range(len(s.rows))


@dataclass(frozen=True)
class VerifyOutput:
    """What one run leaves in the buffers (views; with graphs valid until the next replay of the key)."""

    verdict: DeviceVerdict  # per request [R] / [R, 1 + nextn], placeholders included
    tokens: torch.Tensor  # int64 [R·(1 + nextn)]: each sampled row's emitted token (0 elsewhere)
    logprobs: torch.Tensor  # fp32 [R·(1 + nextn)]: that token's logprob (−inf on error rows)
    processed: ProcessedLogits | None  # [R·(1 + nextn), ..] the rows' processing (key.sampling; None: copied in)


class StaticVerify:
    def __init__(
        self,
        model: DeepseekV41,
        cache: CacheEngine,
        key: VerifyKey,
        nextn: int,
        share: StaticVerify | None = None,
        slot_probs: torch.Tensor | None = None,
    ) -> None:
        """``share``: a static verify of as many requests or more whose input buffers this one uses the first
        rows of (static verifies never run at once, and each fill rewrites what its run reads). ``slot_probs``
        (rejection mode): fp32 [state slots, nextn, V], each state slot's latest draft distributions, which the
        static proposal writes (``DraftProposalGraphs.slot_probs``); the run reads its requests' slots there, so nothing
        is copied per request (None: ``fill`` copies each request's in)."""
        if model.draft is None:
            raise ValueError("a static verify needs a model with a DSpark draft")
        if key.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {key.mode!r}")
        if share is not None and (
            share.key.num_requests < key.num_requests
            or share.key.mode != key.mode
            or (share.key.sampling is None) != (key.sampling is None)
        ):
            raise ValueError(f"the static verify of {key} cannot share the buffers of {share.key}")
        self.model, self.cache, self.key, self.nextn = model, cache, key, nextn
        r, m, width = key.num_requests, num_entries(nextn), 1 + nextn
        device, v = model.embed.weight.device, model.cfg.vocab_size
        self.num_rows = r * width  # the sampled-row capacity
        self.num_entries, self.window = m, cache.layout.draft_window
        # One packed int64 upload: the entries' plan rows [R·M], the requests' table [R, NUM_COLUMNS + nextn], then
        # (key.sampling) the rows' sampling table (SamplingKey.pack).
        size = r * m + r * (NUM_COLUMNS + nextn)
        num_table = 0 if key.sampling is None else key.sampling.size(self.num_rows)
        self.packed = torch.zeros(size + num_table, dtype=torch.int64, device=device)
        self.entry_rows = self.packed[: r * m]
        self.table = self.packed[r * m : size].view(r, NUM_COLUMNS + nextn)
        self.sampling_table = self.packed[size:]
        proj = model.draft.main_proj.weight  # the taps' projection: the taps buffer takes its width and dtype

        def buffer(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
            if share is not None:
                return getattr(share, name)[: shape[0]]
            return torch.zeros(shape, dtype=dtype, device=device)

        if key.sampling is None:  # the step's processed distributions
            self.probs = buffer((self.num_rows, v), torch.float32, "probs")
            self.logprobs = buffer((self.num_rows, v), torch.float32, "logprobs")
            self.errors = buffer((self.num_rows,), torch.bool, "errors")
        else:  # the step's logits, processed by the run
            self.logits = buffer((self.num_rows, v), torch.float32, "logits")
        self.taps = buffer((r * m, proj.shape[1]), proj.dtype, "taps")  # the entries' taps
        self.slot_probs = slot_probs if key.mode == "rejection" else None
        self.draft_probs = (
            buffer((r, nextn, v), torch.float32, "draft_probs")
            if key.mode == "rejection" and slot_probs is None
            else None
        )  # rejection: each request's draft distributions, copied in

    def pack(
        self, sampling: Sequence[Sampling], rows: Sequence[SamplingRow], forced: Sequence[int] | None
    ) -> torch.Tensor:
        """The packed host tensor of ``sampling`` (empty: every request a placeholder)."""
        key, nextn, m = self.key, self.nextn, self.num_entries
        if len(sampling) > key.num_requests:
            raise ValueError(f"{len(sampling)} requests do not fit the static verify of {key}")
        entry_rows = [0] * (key.num_requests * m)
        table = [list(_PLACEHOLDER) + [0] * nextn for _ in range(key.num_requests)]
        for r, s in enumerate(sampling):
            first_row = rows[s.span.start]
            if not 0 <= first_row.position < (1 << 60) - 1 - nextn:
                raise ValueError(f"a draw's position must be in [0, 2**60), got {first_row.position}")
            entries = _entries(s, self.window)
            if len(entries) > m or s.num_rows > 1 + nextn:
                raise ValueError(
                    f"a request of {s.num_rows} sampled rows and {len(entries)} entries does not fit {key}"
                )
            entry_rows[r * m : r * m + len(entries)] = [s.rows[j] for j in entries]
            table[r] = [
                s.span.start,
                s.num_rows,
                len(s.drafts),
                signed_seed(first_row.seed),
                int(first_row.temperature == 0),
                first_row.position,
                s.slot,
                s.first,
                int(s.num_rows == 1),
                len(entries),
                entries.start,
                0 if forced is None else forced[r],
            ] + (s.drafts + [0] * (nextn - len(s.drafts)))
        flat = entry_rows + [c for row in table for c in row]
        if key.sampling is not None:
            flat += key.sampling.pack(rows, self.num_rows, self.model.cfg.vocab_size)
        return torch.tensor(flat, dtype=torch.int64)

    def fill(
        self,
        sampling: Sequence[Sampling],
        rows: Sequence[SamplingRow],
        processed: ProcessedLogits | None,
        taps: torch.Tensor | None,
        draft_probs: Sequence[torch.Tensor | None] = (),
        forced: Sequence[int] | None = None,
        logits: torch.Tensor | None = None,
    ) -> None:
        """One packed upload, then device copies of the step's distributions (``processed``: the sampled rows;
        with ``key.sampling``, ``logits`` [rows, V] instead, which the run processes),
        the entries' taps (``taps``: the plan's rows) and, rejection mode, each request's draft distributions
        (None: it has none; its drafts are not verified, so the stale buffer row is never read).
        ``sampling`` empty with ``processed``/``taps`` None: placeholders only (the capture's warm-up)."""
        upload_into(self.packed, self.pack(sampling, rows, forced))
        if (self.key.sampling is None) != (logits is None) and (processed is not None or logits is not None):
            raise ValueError(
                f"the static verify of {self.key} takes the step's "
                f"{'processed distributions' if self.key.sampling is None else 'logits'}"
            )
        if logits is not None:
            if logits.shape[0] != len(rows) or logits.shape[1] != self.logits.shape[1]:
                raise ValueError(f"logits {tuple(logits.shape)} do not fit {len(rows)} rows of {self.logits.shape[1]}")
            self.logits[: logits.shape[0]].copy_(logits)  # fp32, as Sampler.process's own copy
        elif processed is not None:
            n = processed.probs.shape[0]
            self.probs[:n].copy_(processed.probs)
            self.logprobs[:n].copy_(processed.logprobs)
            self.errors[:n].copy_(processed.errors)
        if taps is not None:
            if taps.dtype != self.taps.dtype or taps.shape[1] != self.taps.shape[1]:
                raise ValueError(
                    f"taps {taps.dtype} [.., {taps.shape[1]}] do not fit the draft's projection "
                    f"{self.taps.dtype} [.., {self.taps.shape[1]}]"
                )
            torch.index_select(taps, 0, self.entry_rows, out=self.taps)
        if self.draft_probs is not None:
            for r, q in enumerate(draft_probs):
                if q is not None:
                    q = q[: self.nextn]
                    self.draft_probs[r, : q.shape[0]].copy_(q)

    def run(self) -> VerifyOutput:
        """Buffers → the verdicts, the sampled rows' tokens and logprobs, and the context writes."""
        t, key, k = self.table, self.key, self.nextn
        device = t.device
        start, num_rows, num_drafts = t[:, START], t[:, NUM_ROWS], t[:, NUM_DRAFTS]
        drafts = t[:, NUM_COLUMNS:]  # [R, K]
        greedy = t[:, GREEDY].bool()
        processed = None
        if key.sampling is None:
            all_probs, all_logprobs, all_errors = self.probs, self.logprobs, self.errors
        else:
            processed = process(self.logits, key.sampling.unpack(self.sampling_table, self.num_rows))
            all_probs, all_logprobs, all_errors = processed.probs, processed.logprobs, processed.errors
        j = torch.arange(1 + k, device=device)
        index = start.unsqueeze(1) + torch.minimum(j, (num_rows - 1).clamp_min(0).unsqueeze(1))  # [R, K + 1]
        probs = all_probs[index]  # [R, K + 1, V]
        errors = all_errors[index].any(-1)  # [R]
        verified = torch.arange(k, device=device) < num_drafts.unsqueeze(1)  # [R, K]
        positions = t[:, POSITION].unsqueeze(1) + j  # [R, K + 1]: P + j
        seeds = t[:, SEED]
        if key.mode == "rejection":
            draws = {
                case: device_draws(seeds, positions[:, :k] if case == DrawCase.ACCEPT else positions, case)
                for case in (DrawCase.ACCEPT, DrawCase.RESAMPLE, DrawCase.SAMPLE)
            }
            q = self.draft_probs if self.slot_probs is None else self.slot_probs[t[:, SLOT]]  # [R, K, V]
            v = rejection_verdict(probs, q, drafts, greedy, verified, draws)
            num_accepted, tokens = v.num_accepted, v.tokens
        elif key.mode == "deterministic":
            v = deterministic_verdict(all_logprobs[index], drafts, seeds, positions, greedy, verified)
            num_accepted, tokens = v.num_accepted, v.tokens
        else:  # forced: the benchmark's counts, the target's argmax after them
            num_accepted = t[:, FORCED]
            at = num_accepted.unsqueeze(1)
            last = probs.gather(1, at.unsqueeze(-1).expand(-1, 1, probs.shape[2]))[:, 0]  # [R, V]
            tokens = torch.cat((drafts, drafts.new_zeros(key.num_requests, 1)), dim=1).scatter(
                1, at, last.argmax(-1, keepdim=True)
            )
        # Each sampled row's token: a request's emitted ones on its first rows, 0 on the rest and on error
        # requests; a placeholder's (and a request's unused columns') writes go to the dump row.
        mine = j < num_rows.unsqueeze(1)  # [R, K + 1]
        emitted = mine & (j <= num_accepted.unsqueeze(1)) & ~errors.unsqueeze(1)
        targets = torch.where(mine, start.unsqueeze(1) + j, self.num_rows)  # [R, K + 1]
        row_tokens = torch.zeros(self.num_rows + 1, dtype=torch.int64, device=device).scatter(
            0, targets.flatten(), torch.where(emitted, tokens, 0).flatten()
        )[: self.num_rows]
        chosen = all_logprobs.gather(1, row_tokens.unsqueeze(-1)).squeeze(-1).masked_fill(all_errors, -math.inf)
        self._write_context(num_accepted, errors)
        return VerifyOutput(DeviceVerdict(errors, num_accepted, tokens), row_tokens, chosen, processed)

    def _write_context(self, num_accepted: torch.Tensor, errors: torch.Tensor) -> None:
        """The draft's context K=V of every entry the verdict keeps, the ring's old value elsewhere; entries W or
        more apart go in passes of W, in order, so the last kept one wins (``accepted_context.write_context``)."""
        t, m, w = self.table, self.num_entries, self.window
        draft = self.model.draft
        e = torch.arange(m, device=t.device)
        offsets = t[:, J0].unsqueeze(1) + e  # [R, M]: the entry's row offset j in its request
        real = e < t[:, NUM_ENTRIES].unsqueeze(1)
        positions = t[:, FIRST].unsqueeze(1) + offsets  # [R, M]
        keep = ((offsets <= num_accepted.unsqueeze(1)) | t[:, WHOLE].bool().unsqueeze(1)) & ~errors.unsqueeze(1) & real
        slots = torch.where(real, t[:, SLOT].unsqueeze(1), 0)  # the null slot 0 for unused entries
        columns = positions % w
        ctx = draft.context(self.taps.unsqueeze(0))  # [1, R·M, D]
        kv = [
            draft.context_kv(s, ctx, positions.view(1, -1))[0].float().view(*positions.shape, -1)
            for s in range(len(draft.stages))
        ]  # per stage [R, M, hd]
        for p in range(0, m, w):
            sel_slots, sel_columns, sel_keep = (x[:, p : p + w].flatten() for x in (slots, columns, keep))
            for stage, values in enumerate(kv):
                ring = self.cache.draft_ring(stage)
                old = ring[sel_slots, sel_columns]
                ring[sel_slots, sel_columns] = torch.where(
                    sel_keep.unsqueeze(-1), values[:, p : p + w].flatten(0, 1), old
                )


class VerifyGraphs:
    """Static verifies per ``VerifyKey``, replayed from CUDA graphs (``use_graphs``) or run eagerly."""

    def __init__(
        self,
        model: DeepseekV41,
        nextn: int,
        use_graphs: bool,
        slot_probs: Callable[[CacheEngine], torch.Tensor] | None = None,
    ) -> None:
        """``slot_probs``: a cache's per-slot draft distributions (see ``StaticVerify``), read by rejection keys."""
        device = model.embed.weight.device
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on CUDA, not {device}")
        self.model, self.nextn, self.use_graphs, self.slot_probs = model, nextn, use_graphs, slot_probs
        self.cache: CacheEngine | None = None  # the pools the static verifies write (a graph holds their tensors)
        self.static: dict[VerifyKey, StaticVerify] = {}
        self.graphs: dict[VerifyKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[VerifyKey, VerifyOutput] = {}
        self._pool: Any = None  # one memory pool shared by every verify graph (they never run at once)
        self.num_replays = 0
        self.num_captures = 0  # graphs captured over its life (one per key and cache: more means re-captures)

    def verify(
        self,
        key: VerifyKey,
        cache: CacheEngine,
        sampling: Sequence[Sampling],
        rows: Sequence[SamplingRow],
        processed: ProcessedLogits | None,
        taps: torch.Tensor,
        draft_probs: Sequence[torch.Tensor | None] = (),
        forced: Sequence[int] | None = None,
        logits: torch.Tensor | None = None,
    ) -> VerifyOutput:
        """The static verify of ``key`` filled with this step and run (see ``StaticVerify.fill``); the outputs
        cover the bucket (the caller slices its requests' and rows' part)."""
        static = self._static(cache, key)
        static.fill(sampling, rows, processed, taps, draft_probs, forced, logits)
        if not self.use_graphs:
            return static.run()
        self.graphs[key].replay()
        self.num_replays += 1
        return self.outputs[key]

    def capture(self, cache: CacheEngine, keys: list[VerifyKey]) -> None:
        """Builds (and with graphs captures) the static verifies of ``keys`` now, largest first (the smaller ones
        share its input buffers and graph memory)."""
        for key in sorted(keys, key=lambda k: k.num_requests, reverse=True):
            self._static(cache, key)

    def _static(self, cache: CacheEngine, key: VerifyKey) -> StaticVerify:
        if cache is not self.cache:  # other pools: the captured graphs write the old ones' tensors
            self.static.clear(), self.graphs.clear(), self.outputs.clear()
            self.cache = cache
        static = self.static.get(key)
        if static is None:
            share = max(
                (
                    s
                    for s in self.static.values()
                    if s.key.mode == key.mode and (s.key.sampling is None) == (key.sampling is None)
                ),
                key=lambda s: s.key.num_requests,
                default=None,
            )
            if share is not None and share.key.num_requests < key.num_requests:
                share = None  # a larger bucket than any so far: its own buffers, which later smaller ones share
            slot_probs = self.slot_probs(cache) if self.slot_probs is not None and key.mode == "rejection" else None
            static = self.static[key] = StaticVerify(self.model, cache, key, self.nextn, share, slot_probs)
        if self.use_graphs and key not in self.graphs:
            static.fill((), (), None, None)  # placeholders only: the warm-up really runs, and writes only slot 0
            graph, self.outputs[key], self._pool = capture_graph(static.run, self._pool)
            self.graphs[key] = graph
            self.num_captures += 1
            log.info("captured the verify graph of %s", key)
        return static
