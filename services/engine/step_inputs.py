"""What the worker takes with a step's plan besides the plan: one ``SamplingRow`` per sampled row, and the keyword
extras (the prompt rows whose logprobs were asked for, structured output's token mask)."""

from __future__ import annotations

import functools
from typing import Any

from scheduler_rs import StepPlan
from services.engine.engine_parts import EngineParts
from services.engine.prompt_logprob_rows import prompt_rows
from services.worker.sampling.sampler import SamplingRow
from services.worker.worker_output import WorkerOutput


class StepInputs:
    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.requests = parts.requests  # the engine's live requests (the same dict)
        self.structured = parts.structured

    def rows(self, plan: StepPlan, in_flight: tuple[StepPlan, WorkerOutput] | None = None) -> list[SamplingRow]:
        """The plan's sampling rows, request by request in plan order. ``in_flight``: the step planned before this
        one and not yet updated (async scheduling), whose tokens count as accepted, as the scheduler counts them."""
        rows = []
        seqlens_k = plan.seqlens_k.tolist()
        ahead: dict[str, int] = {}
        if in_flight is not None:
            ahead = dict(zip(in_flight[0].request_ids, in_flight[0].num_sample_rows.tolist()))
        request_ids = plan.request_ids  # one conversion: each access of the attribute builds a new list
        for i, n in enumerate(plan.num_sample_rows.tolist()):
            if n == 0:
                continue
            req = self.requests[request_ids[i]]
            num_out = len(req.output.token_ids) + ahead.get(request_ids[i], 0)
            rows += req.sampling_rows(n, seqlens_k[i], num_out, self.parts.config)
        return rows

    def prompt_rows(self, plan: StepPlan) -> dict[str, Any]:
        """The worker's ``prompt_rows`` keyword (prompt_logprob_rows.py); empty when no planned row needs one."""
        return prompt_rows(plan, self.requests)

    def extras(self, plan: StepPlan) -> dict[str, Any]:
        """Every keyword extra of ``Worker.execute``: ``prompt_rows`` when it has rows, and the ``token_bitmask`` while
        a live request walks a grammar, as the function that fills it: the worker calls it once the step's forward
        is launched, so on a GPU the fill overlaps the forward (the mask is a sampler input only)."""
        extra = self.prompt_rows(plan)
        if self.structured.has_matchers(self.requests):
            extra["token_bitmask"] = functools.partial(self.structured.token_bitmask, plan, self.requests)
        return extra
