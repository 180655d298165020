"""What the worker takes with a step's plan besides the plan: one ``SamplingRow`` per sampled row, and the keyword
extras (the prompt rows whose logprobs were asked for, structured output's token mask)."""

from __future__ import annotations

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
        """Every keyword extra of ``Worker.execute``: ``prompt_rows`` and the ``token_bitmask``, each when it has
        rows."""
        extra = self.prompt_rows(plan)
        mask = self.structured.token_bitmask(plan, self.requests)
        if mask is not None:
            extra["token_bitmask"] = mask
        return extra
