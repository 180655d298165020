"""Per step, the token bitmask of the planned sampled rows (services/worker/sampling/token_bitmask.py has the
layout), filled from each constrained request's matcher; and the matcher's advance once the step's tokens are read.

Without speculative decoding a request samples at most one row a step, so a matcher's state is exactly the one
its next row needs: it advances by the token read back before the next step's mask is filled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from scheduler_rs import StepPlan
from services.engine.live_request import LiveRequest
from services.engine.structured.grammars import GrammarCompiler


def fill_token_bitmask(
    plan: StepPlan, requests: Mapping[str, LiveRequest], grammars: GrammarCompiler | None
) -> torch.Tensor | None:
    """int32 [sampled rows, ceil(V / 32)] on the host, all bits set for unconstrained rows; None when no planned
    row is constrained (the sampler then skips the mask)."""
    if grammars is None:
        return None
    counts = plan.num_sample_rows.tolist()
    request_ids = plan.request_ids
    constrained = [(i, requests[request_ids[i]].matcher) for i, n in enumerate(counts) if n]
    if not any(m is not None for _, m in constrained):
        return None
    mask = grammars.bitmask(sum(counts))
    row = 0
    for i, n in enumerate(counts):
        matcher = requests[request_ids[i]].matcher if n else None
        if matcher is not None:
            if n != 1:
                raise ValueError("a constrained request samples one row a step (speculative decoding is refused)")
            matcher.fill_next_token_bitmask(mask, row)
        row += n
    return mask


def advance(matcher, token_ids: Sequence[int]) -> bool:
    """Feeds the step's tokens to the request's matcher; False when the grammar refuses one (a dead end)."""
    for token in token_ids:
        if matcher.is_terminated() or not matcher.accept_token(int(token)):
            return False
    return True
