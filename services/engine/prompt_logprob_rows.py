"""Prompt logprobs, the engine's side: which rows of a step the worker reads them at (``prompt_rows``), and how
its answer lands in each request's output (``add_prompt_logprobs``). Each prompt position is taken once, in
order: a recomputed prompt (preemption) gives none twice, a chunked one continues where the last chunk ended."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from scheduler_rs import StepPlan
from services.worker.prompt_logprobs import PromptLogprobs, PromptRows


def _wanting(plan: StepPlan, requests: Mapping[str, Any]) -> list[tuple[int, Any]]:
    """(plan index, request) of the planned requests that asked for prompt logprobs; a request has ``params``
    (SamplingParams) and ``output`` (RequestOutput)."""
    return [
        (i, req)
        for i, rid in enumerate(plan.request_ids)
        if (req := requests.get(rid)) is not None and req.params.prompt_logprobs is not None
    ]


def prompt_rows(plan: StepPlan, requests: Mapping[str, Any]) -> dict[str, PromptRows]:
    """The worker's ``prompt_rows`` argument (as keyword arguments): the plan's prompt rows whose logprobs their
    requests asked for and do not have yet; none when there are none."""
    wanted = _wanting(plan, requests)
    if not wanted:
        return {}
    positions, starts = plan.positions.tolist(), plan.query_start.tolist()
    rows, targets, num_top = [], [], 0
    for i, req in wanted:
        prompt, done = req.output.prompt_token_ids, len(req.output.prompt_logprobs or ())
        for row in range(starts[i], starts[i + 1]):
            if done <= positions[row] < len(prompt) - 1:
                rows.append(row)
                targets.append(prompt[positions[row] + 1])
        num_top = max(num_top, req.params.prompt_logprobs or 0)
    return {"prompt_rows": PromptRows(rows, targets, num_top)} if rows else {}


def add_prompt_logprobs(plan: StepPlan, requests: Mapping[str, Any], found: PromptLogprobs | None) -> None:
    """Appends the step's prompt logprobs (the rows ``prompt_rows`` named, in its order) to their requests'
    ``prompt_logprobs`` and ``prompt_top_logprobs``."""
    if found is None:
        return
    lps, ids, tops = found.logprobs.tolist(), found.top_token_ids.tolist(), found.top_logprobs.tolist()
    ranks = found.ranks.tolist()
    positions, starts, k = plan.positions.tolist(), plan.query_start.tolist(), 0
    for i, req in _wanting(plan, requests):
        out, n = req.output, req.params.prompt_logprobs
        if out.prompt_logprobs is None or out.prompt_top_logprobs is None or out.prompt_ranks is None:
            out.prompt_logprobs, out.prompt_top_logprobs, out.prompt_ranks = [], [], []
        for row in range(starts[i], starts[i + 1]):
            if len(out.prompt_logprobs) <= positions[row] < len(out.prompt_token_ids) - 1:
                out.prompt_logprobs.append(lps[k])
                out.prompt_top_logprobs.append(list(zip(ids[k][:n], tops[k][:n])))
                out.prompt_ranks.append(ranks[k])
                k += 1
