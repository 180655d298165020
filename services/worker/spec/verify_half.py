"""A speculative step's verify half, as the speculator (services/worker/spec/speculator.py) runs it: the eager
verification of every sampling request (``eager_verdict``: services/worker/spec/verifier.py on the step's processed
distributions), or one static verify (``static_verify``: services/worker/spec/static_verify.py, a CUDA graph per
bucket with ``cuda_graphs``), which also writes the accepted context and gives the sampled rows' tokens and,
where its key has a ``SamplingKey``, processes the step's logits itself (no eager ``Sampler.process``).

Both give the same verdicts, context writes and sampler output for the same step (tests/services/worker/
test_static_verify.py); what differs is only how many eager ops run outside the graphs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kernels.device import upload
from kernels.sampler_output import SamplerOutput
from services.worker.sampling.sampler import ProcessedLogits, SamplingRow
from services.worker.spec.accepted_context import DeviceVerdict, Sampling, with_top
from services.worker.spec.forced_acceptance import ForcedAcceptance
from services.worker.spec.static_verify import VerifyGraphs, VerifyKey
from services.worker.spec.verifier import verify_deterministic, verify_rejection
from services.worker.state.cache_engine import CacheEngine


def forced_counts(
    forced_acceptance: ForcedAcceptance | None, sampling: Sequence[Sampling], rows: Sequence[SamplingRow]
) -> list[int] | None:
    """The benchmark's accepted count per request (None: no forced acceptance); greedy requests only."""
    if forced_acceptance is None:
        return None
    if any(rows[s.span.start].temperature != 0 for s in sampling):
        raise ValueError("forced acceptance (a benchmark switch) runs greedy requests only (temperature 0)")
    return [forced_acceptance.num_accepted(len(s.drafts)) for s in sampling]


def eager_verdict(
    sampling: Sequence[Sampling],
    rows: Sequence[SamplingRow],
    processed: ProcessedLogits,
    spec_sampling: str,
    forced: Sequence[int] | None,
    draft_probs: Mapping[str, torch.Tensor],
) -> DeviceVerdict | None:
    """Every sampling request's verdict at once, on the device (services/worker/spec/verifier.py); ``forced``: the
    benchmark's counts instead. Requests pad to the widest (their last row repeated; drafts past their own are
    not verified); ``draft_probs``: per request id its draft distributions (rejection mode)."""
    if not sampling:
        return None
    device = processed.probs.device
    width = max(s.num_rows for s in sampling)  # K + 1
    index = upload(
        torch.tensor(
            [[s.span.start + min(j, s.num_rows - 1) for j in range(width)] for s in sampling], dtype=torch.int64
        ),
        device,
    )  # [R, K + 1]
    probs = processed.probs[index]  # [R, K + 1, V]
    errors = processed.errors[index].any(-1)  # [R]
    drafts = upload(
        torch.tensor([s.drafts + [0] * (width - 1 - len(s.drafts)) for s in sampling], dtype=torch.int64).view(
            len(sampling), width - 1
        ),
        device,
    )
    if forced is not None:  # the benchmark's verdict replaces the verifier's
        num_accepted = upload(torch.tensor(forced, dtype=torch.int64), device)
        at = torch.arange(len(sampling), device=device)
        tokens = torch.cat((drafts, drafts.new_zeros(len(sampling), 1)), dim=1)
        tokens[at, num_accepted] = probs[at, num_accepted].argmax(-1)
        return DeviceVerdict(errors, num_accepted, tokens)
    firsts = [rows[s.span.start] for s in sampling]
    greedy = upload(torch.tensor([row.temperature == 0 for row in firsts]), device)
    seeds, positions = [row.seed for row in firsts], [row.position for row in firsts]
    num_drafts = [len(s.drafts) for s in sampling]
    if spec_sampling == "rejection":
        q = torch.stack([_padded(draft_probs.get(s.request_id), width - 1, probs.shape[-1], device) for s in sampling])
        v = verify_rejection(probs, q, drafts, seeds, positions, greedy, num_drafts)
    else:
        v = verify_deterministic(processed.logprobs[index], drafts, seeds, positions, greedy, num_drafts)
    return DeviceVerdict(errors, v.num_accepted, v.tokens)


def static_verify(
    graphs: VerifyGraphs,
    key: VerifyKey,
    sampling: Sequence[Sampling],
    rows: Sequence[SamplingRow],
    processed: ProcessedLogits | None,
    logits: torch.Tensor,
    taps: torch.Tensor,
    cache: CacheEngine,
    num_top: int,
    forced: Sequence[int] | None,
    draft_probs: Mapping[str, torch.Tensor],
) -> tuple[DeviceVerdict, SamplerOutput]:
    """``eager_verdict``, ``write_context`` and ``emitted_output`` as one static verify of the step's bucket: the
    same verdicts, context writes and sampled rows. ``processed``: the step's processing (a key without
    ``sampling``); with one, the run processes ``logits`` itself and ``processed`` is None."""
    # Rejection: each request's draft distributions copied in, unless the run reads them from the slots' buffer.
    kept = (
        [draft_probs.get(s.request_id) for s in sampling]
        if key.mode == "rejection" and graphs.slot_probs is None
        else []
    )
    out = graphs.verify(
        key, cache, sampling, rows, processed, taps, kept, forced, logits if key.sampling is not None else None
    )
    num_r, num_rows = len(sampling), logits.shape[0]
    v = out.verdict
    verdict = DeviceVerdict(v.errors[:num_r], v.num_accepted[:num_r], v.tokens[:num_r])
    if processed is None:  # the run's own: the top-n reads it now; its errors outlive the next replay, so copied
        p = out.processed
        processed = ProcessedLogits(
            p.banned[:num_rows],
            p.logprobs[:num_rows],
            p.probs[:num_rows],
            p.errors[:num_rows].clone(),
            p.ranked_rows,
            p.order[:num_rows],
        )
    # The rows' tokens and logprobs outlive the next replay (the engine may copy them later), so copied.
    sampled = with_top(processed, out.tokens[:num_rows].clone(), out.logprobs[:num_rows].clone(), num_top)
    return verdict, sampled


def _padded(q: torch.Tensor | None, k: int, vocab_size: int, device: torch.device) -> torch.Tensor:
    """fp32 [k, V]: a request's first k draft distributions (zeros where it has none)."""
    if q is None:
        return torch.zeros(k, vocab_size, device=device)
    return torch.cat((q[:k], q.new_zeros(max(k - q.shape[0], 0), vocab_size)))
