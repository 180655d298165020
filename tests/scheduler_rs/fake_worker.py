"""A stand-in worker for scheduler tests: turns a StepPlan into a StepResult without a model.

Tokens come from a caller-supplied function of (request id, position), so a test decides exactly
what each request generates; decode accepts a caller-chosen number of drafts.
"""

from __future__ import annotations

from collections.abc import Callable

from scheduler_rs import StepPlan, StepResult


def run_step(
    plan: StepPlan,
    token_at: Callable[[str, int], int],
    num_accepted: Callable[[str, int], int] | None = None,
    nextn: int = 0,
    errors: tuple[int, ...] = (),
) -> StepResult:
    """``token_at(request_id, position)`` is the token generated at ``position``;
    ``num_accepted(request_id, num_drafts)`` how many drafts pass (default none)."""
    num_tokens: list[int] = []
    token_ids: list[int] = []
    seqlens_k = plan.seqlens_k.tolist()
    num_sample_rows = plan.num_sample_rows.tolist()
    for i, request_id in enumerate(plan.request_ids):
        if i in errors:
            num_tokens.append(0)
            continue
        sampled = num_sample_rows[i]
        if i >= plan.num_decode_requests:  # a prompt chunk
            n = sampled
            first = seqlens_k[i]
        else:
            drafts = sampled - 1
            n = 1 + (num_accepted(request_id, drafts) if num_accepted else 0)
            first = seqlens_k[i] - sampled + 1
        num_tokens.append(n)
        token_ids.extend(token_at(request_id, first + j) for j in range(n))
    num_draft_tokens = [nextn] * plan.num_requests if nextn else None
    draft_ids = [7] * (nextn * plan.num_requests) if nextn else None
    return StepResult(num_tokens, token_ids, num_draft_tokens, draft_ids, list(errors))
