"""The draft's context of the rows a speculative step accepts, written on the device before the host knows
how many were accepted (services/worker/spec/speculator.py reads the step back once, after the proposal).

Per request that samples (``Sampling``), the verdict (``DeviceVerdict``, on the device) says how many of its
drafts passed; ``write_context`` then writes the draft's context K=V of its accepted rows into its state slot's
rings, as ``CacheEngine.write_draft`` of those rows would: each candidate row is computed, and the ring keeps
the new value where the verdict accepts the row, its old value elsewhere. ``emitted_output`` gives the step's
sampler output (each row's token, logprob and top-n) from the verdict and the processed distributions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kernels.device import upload
from kernels.sampler_output import SamplerOutput
from model.deepseek_v41.dspark import DSpark
from services.worker.sampling.sampler import ProcessedLogits
from services.worker.state.cache_engine import CacheEngine


@dataclass(frozen=True)
class Sampling:
    """A request that samples this step (a decode request, or a prompt's last chunk), from the plan."""

    index: int  # its index in the plan's requests
    request_id: str
    span: slice  # its sampled rows in the step's sampling rows (and logits)
    rows: list[int]  # its rows in the plan
    slot: int  # its state slot
    first: int  # the position of its first row
    drafts: list[int]  # the drafts its rows 1 … verify (fewer than the rows − 1 when it had fewer)

    @property
    def num_rows(self) -> int:
        """Sampled rows: 1 + the drafts verified."""
        return self.span.stop - self.span.start


@dataclass(frozen=True)
class DeviceVerdict:
    """Every sampling request's verification, on the device, read back once with the proposal."""

    errors: torch.Tensor  # bool [R]: some row's logits were not finite (the request fails, emits nothing)
    num_accepted: torch.Tensor  # int64 [R]: drafts accepted
    tokens: torch.Tensor  # int64 [R, K + 1]: columns 0 … num_accepted are emitted


def write_context(
    draft: DSpark, sampling: list[Sampling], verdict: DeviceVerdict, taps: torch.Tensor, cache: CacheEngine
) -> None:
    """The draft's context K=V of every sampling request's accepted rows into its state slot's rings, on the
    device: every candidate row is computed, and written where the verdict keeps it (a decode request's
    rows 0 … a, a last prompt chunk's rows (its last W: all a ring holds), nothing for an error), the
    ring's old value elsewhere. Rows of one request W or more apart share a column, so they go in passes
    of W rows, in order, and the last kept row wins, as in ``CacheEngine.write_draft``."""
    w = cache.layout.draft_window
    entries = []  # (sampling index, offset j in the request's rows, plan row, kept whatever the verdict)
    for r, s in enumerate(sampling):
        whole = s.num_rows == 1  # a last prompt chunk (or a decode row without drafts): every row is accepted
        offsets = range(max(len(s.rows) - w, 0), len(s.rows)) if whole else range(len(s.rows))
        entries.extend((r, j, s.rows[j], whole) for j in offsets)
    device = taps.device
    host = torch.tensor(
        [(r, j, row, sampling[r].first + j, sampling[r].slot, whole) for r, j, row, whole in entries], dtype=torch.int64
    )
    t = upload(host, device)
    positions = t[:, 3]
    ctx = draft.context(taps[t[:, 2]].unsqueeze(0))  # [1, N, D]
    kv = [draft.context_kv(k, ctx, positions.unsqueeze(0))[0].float() for k in range(len(draft.stages))]
    keep = ((t[:, 1] <= verdict.num_accepted[t[:, 0]]) | t[:, 5].bool()) & ~verdict.errors[t[:, 0]]  # [N]
    slots, columns = t[:, 4], positions % w
    passes: dict[int, list[int]] = {}  # pass → its entries
    for e, (_, j, _, _) in enumerate(entries):
        passes.setdefault(j // w, []).append(e)
    for p in sorted(passes):
        sel = upload(torch.tensor(passes[p], dtype=torch.int64), device)
        for k, values in enumerate(kv):
            ring = cache.draft_ring(k)
            old = ring[slots[sel], columns[sel]]
            ring[slots[sel], columns[sel]] = torch.where(keep[sel].unsqueeze(-1), values[sel], old)


def emitted_output(
    processed: ProcessedLogits, verdict: DeviceVerdict | None, sampling: list[Sampling], num_top: int
) -> SamplerOutput:
    """The step's sampler output, by device ops on the verification's own processed distributions: each sampled
    row's token (a request's emitted tokens on its first rows; 0 on the rest, and on every row of an error
    request) with its logprob, and the top ``num_top`` (``processed`` ranked every row when ``num_top`` > 0).
    What ``Sampler.__call__`` returns for the same rows with those tokens forced, without its second pass over
    the logits or its draws. ``sampling``'s spans cover the rows in order."""
    p = processed
    num_rows, device = p.logprobs.shape[0], p.logprobs.device
    owners = [(r, j) for r, s in enumerate(sampling) for j in range(s.num_rows)]  # per row: (request, offset)
    if len(owners) != num_rows:
        raise ValueError(f"the sampling requests' spans cover {len(owners)} rows, the logits have {num_rows}")
    if verdict is None or not owners:
        tokens = torch.zeros(num_rows, dtype=torch.int64, device=device)
    else:
        t = upload(torch.tensor(owners, dtype=torch.int64), device)  # [N, 2]
        r, j = t[:, 0], t[:, 1]
        emitted = (j <= verdict.num_accepted[r]) & ~verdict.errors[r]  # [N]
        tokens = torch.where(emitted, verdict.tokens[r, j], 0)
    # An error row's request is an error request (the verdict's errors are its rows' any), so its token is 0.
    chosen = p.logprobs.gather(1, tokens.unsqueeze(-1)).squeeze(-1).masked_fill(p.errors, -math.inf)
    return with_top(p, tokens, chosen, num_top)


def with_top(processed: ProcessedLogits, tokens: torch.Tensor, chosen: torch.Tensor, num_top: int) -> SamplerOutput:
    """The sampler output of the rows' ``tokens`` [N] and their logprobs ``chosen`` [N], with the top ``num_top``
    of the processed distributions (``processed`` ranked every row when ``num_top`` > 0)."""
    p = processed
    num_rows, device = p.logprobs.shape[0], p.logprobs.device
    if num_top == 0:  # empty: no gather or mask to launch
        top_ids = torch.empty(num_rows, 0, dtype=torch.int64, device=device)
        return SamplerOutput(
            tokens, chosen, top_ids, torch.empty(num_rows, 0, dtype=p.logprobs.dtype, device=device), p.errors
        )
    top_ids = p.order[:, :num_top].contiguous()
    top_logprobs = p.logprobs.gather(1, top_ids).masked_fill(p.errors.unsqueeze(-1), -math.inf)
    return SamplerOutput(tokens, chosen, top_ids, top_logprobs, p.errors)
