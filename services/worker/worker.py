"""The worker: runs a StepPlan through a model runner and the sampler, and returns a StepResult."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from scheduler_rs import StepPlan, StepResult
from services.worker.reference_runner import RunnerOutput
from services.worker.sampler import Sampler, SamplerOutput, SamplingRow


class ModelRunner(Protocol):
    def execute(self, plan: StepPlan) -> RunnerOutput: ...

    def release(self, request_id: str) -> None: ...


@dataclass
class WorkerOutput:
    result: StepResult
    # Aligned with `plan.sample_rows`; None when nothing was sampled.
    sampled: SamplerOutput | None
    # [num layers, num routed experts] token counts, when the runner counts them.
    expert_counts: torch.Tensor | None
    num_rows_computed: int


class Worker:
    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler()

    def execute(self, plan: StepPlan, rows: Sequence[SamplingRow]) -> WorkerOutput:
        """``rows`` has one entry per sampled row, in ``plan.sample_rows`` order."""
        out = self.runner.execute(plan)
        num_sample_rows = plan.num_sample_rows.tolist()
        if not rows:
            result = StepResult([0] * plan.num_requests, [])
            return WorkerOutput(result, None, out.expert_counts, out.num_rows_computed)
        sampled = self.sampler(out.logits, rows)
        tokens = sampled.token_ids.tolist()
        failed = sampled.errors.tolist()
        num_tokens, token_ids, errors = [], [], []
        row = 0
        for i, n in enumerate(num_sample_rows):
            # Without drafts every sampled row is one request's one token (nextn = 0).
            if n and any(failed[row : row + n]):
                errors.append(i)
                num_tokens.append(0)
            else:
                num_tokens.append(n)
                token_ids.extend(tokens[row : row + n])
            row += n
        return WorkerOutput(StepResult(num_tokens, token_ids, errors=errors), sampled, out.expert_counts,
                            out.num_rows_computed)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)
