"""The worker: runs a StepPlan through a model runner and the sampler, and returns a StepResult."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from scheduler_rs import StepPlan, StepResult
from services.worker.reference_runner import RunnerOutput
from services.worker.step_batch import PendingInputs
from services.worker.sampler import Sampler, SamplerOutput, SamplingRow


class ModelRunner(Protocol):
    def execute(self, plan: StepPlan) -> RunnerOutput: ...
    # A runner that takes async plans also accepts ``pending=PendingInputs`` (see ModelRunner).

    def release(self, request_id: str) -> None: ...


@dataclass
class WorkerOutput:
    result: StepResult
    # Aligned with `plan.sample_rows`; None when nothing was sampled.
    sampled: SamplerOutput | None
    # [num layers, num routed experts] token counts, when the runner counts them.
    expert_counts: torch.Tensor | None
    num_rows_computed: int
    # Per planned request (plan order): its ids and the last token it sampled this step, −1 for none
    # (a non-final chunk, an error). What async scheduling's next step reads for its pending inputs.
    request_ids: list[str] = field(default_factory=list)
    last_token_ids: torch.Tensor | None = None

    def pending_inputs(self) -> PendingInputs:
        """This step's sampled tokens as the next step's pending inputs."""
        tokens = self.last_token_ids if self.last_token_ids is not None else torch.full((len(self.request_ids),), -1)
        return PendingInputs(self.request_ids, tokens)


class Worker:
    def __init__(self, runner: ModelRunner, sampler: Sampler | None = None) -> None:
        """``sampler`` defaults to the runner's backend's: ``KernelSampler`` on its kernel set's sampler
        module for a ``backend == "kernels"`` runner (services/worker/kernel_sampler.py), else ``Sampler``."""
        self.runner = runner
        if sampler is None and getattr(runner, "backend", "torch") == "kernels":
            from services.worker.kernel_sampler import KernelSampler

            kernels = runner.kernels  # type: ignore[attr-defined]
            if kernels.sampler is None:
                raise ValueError("a kernel-backend runner needs a sampler kernel in its KernelSet (or pass sampler=)")
            sampler = KernelSampler(kernels.sampler)  # type: ignore[assignment]
        self.sampler = sampler or Sampler()

    def execute(self, plan: StepPlan, rows: Sequence[SamplingRow], previous: WorkerOutput | None = None
                ) -> WorkerOutput:
        """``rows`` has one entry per sampled row, in ``plan.sample_rows`` order. ``previous`` (async
        scheduling) is the step before this one, whose sampled tokens fill this plan's pending inputs."""
        if previous is not None and any(plan.inputs_pending.tolist()):
            out = self.runner.execute(plan, pending=previous.pending_inputs())  # type: ignore[call-arg]
        else:
            out = self.runner.execute(plan)
        num_sample_rows = plan.num_sample_rows.tolist()
        request_ids = list(plan.request_ids)
        if not rows:
            result = StepResult([0] * plan.num_requests, [])
            return WorkerOutput(result, None, out.expert_counts, out.num_rows_computed, request_ids,
                                torch.full((plan.num_requests,), -1, dtype=torch.long))
        sampled = self.sampler(out.logits, rows)
        tokens = sampled.token_ids.tolist()
        failed = sampled.errors.tolist()
        num_tokens, token_ids, errors, last = [], [], [], []
        row = 0
        for i, n in enumerate(num_sample_rows):
            # Without drafts every sampled row is one request's one token (nextn = 0).
            if n and any(failed[row : row + n]):
                errors.append(i)
                num_tokens.append(0)
                last.append(-1)
            else:
                num_tokens.append(n)
                token_ids.extend(tokens[row : row + n])
                last.append(tokens[row + n - 1] if n else -1)
            row += n
        return WorkerOutput(StepResult(num_tokens, token_ids, errors=errors), sampled, out.expert_counts,
                            out.num_rows_computed, request_ids, torch.tensor(last, dtype=torch.long))

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)
