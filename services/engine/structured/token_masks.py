"""Per step, the token bitmask of the planned sampled rows (services/worker/sampling/token_bitmask.py has the
layout), filled from each constrained request's matcher; and the matcher's advance once the step's tokens are read.

A request's matcher is at the state its next token needs: it advances by the tokens read back before the next
step's mask is filled. With speculative decoding a decode request samples 1 + k rows, the last of its inputs and
its k drafts: row j's mask is the grammar's after the first j drafts, so the matcher accepts them one by one,
filling each row, and rolls them back (the tokens the verification emits are fed at the read-back). Rows after a
draft the grammar refuses stay all-allowed: that draft has probability 0 under its row's mask, so it is rejected
and nothing after it is emitted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from scheduler_rs import StepPlan
from services.engine.live_request import LiveRequest
from services.engine.structured.grammars import GrammarCompiler


def fill_token_bitmask(
    plan: StepPlan, requests: Mapping[str, LiveRequest], grammars: GrammarCompiler
) -> torch.Tensor | None:
    """int32 [sampled rows, ceil(V / 32)] on the host, all bits set for unconstrained rows; None when no planned
    row is constrained (the sampler then skips the mask).

    Under async scheduling the step in flight is read before this step samples, so a planned request may have
    ended meanwhile (its grammar's end, a dead end, its length): its rows stay all-allowed, as they are never
    emitted."""
    counts = plan.num_sample_rows.tolist()
    request_ids = plan.request_ids
    matchers = [_live_matcher(requests.get(request_ids[i])) if n else None for i, n in enumerate(counts)]
    if all(m is None for m in matchers):
        return None
    mask = grammars.bitmask(sum(counts))
    inputs = None  # the plan's input ids and each request's rows, read only for a step with drafts
    single: tuple[list, list[int]] = ([], [])  # the matchers of one row each (no drafts), and their rows
    row = 0
    for i, n in enumerate(counts):
        matcher = matchers[i]
        if matcher is not None and n == 1:
            single[0].append(matcher)
            single[1].append(row)
        elif matcher is not None:
            if inputs is None:
                inputs = (plan.input_ids.tolist(), plan.query_start.tolist(), plan.seqlens_q.tolist())
            end = inputs[1][i] + inputs[2][i]  # the drafts are the request's last n - 1 inputs
            fill_rows(matcher, mask, row, inputs[0][end - n + 1 : end])
        row += n
    if single[0]:
        grammars.fill(single[0], mask, single[1])  # in parallel
    return mask


def _live_matcher(req: LiveRequest | None):
    """A planned request's matcher, None where it has none, has ended, or its grammar has ended."""
    if req is None or req.matcher is None or req.matcher.is_terminated():
        return None
    return req.matcher


def fill_rows(matcher, mask: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
    """Rows ``row`` … ``row + len(drafts)`` of one request: each from the matcher after the drafts before it; the
    matcher ends where it began."""
    matcher.fill_next_token_bitmask(mask, row)
    accepted = 0
    for j, draft in enumerate(drafts, 1):
        if matcher.is_terminated() or not matcher.accept_token(int(draft)):
            break  # this draft is rejected: the rows after it are never emitted (left all-allowed)
        accepted += 1
        if matcher.is_terminated():  # a stop token: the request ends there
            break
        matcher.fill_next_token_bitmask(mask, row + j)
    if accepted:
        matcher.rollback(accepted)


def advance(matcher, token_ids: Sequence[int]) -> bool:
    """Feeds the step's tokens to the request's matcher; False when the grammar refuses one (a dead end)."""
    for token in token_ids:
        if matcher.is_terminated() or not matcher.accept_token(int(token)):
            return False
    return True
