"""A worker's output of one executed step, its result read back from the device on first access."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels.sampler_output import SamplerOutput
from scheduler_rs import StepResult
from services.worker.batch.step_batch import PendingInputs
from services.worker.host_copy import HostCopy, host_sampled, sampled_copy
from services.worker.prompt_logprobs import PromptLogprobs


class WorkerOutput:
    """One executed step. ``result`` (what the scheduler's update takes) is read back from the device
    on first access, not when the step is queued: with async scheduling the engine queues step N+1
    before it reads step N, so the device runs N+1 while the host updates N and plans N+2. Every host
    read of the step's samples goes through ``host`` (services/worker/host_copy.py), whose copies are
    queued when the step is, so reading step N never waits for step N+1. ``on_read_back`` lets a caller see
    when that read-back happens (a trace, a test of the overlap)."""

    def __init__(
        self,
        result: StepResult | Callable[[], StepResult],
        sampled: SamplerOutput | None,
        expert_counts: torch.Tensor | None,
        num_rows_computed: int,
        request_ids: list[str] | None = None,
        last_token_ids: torch.Tensor | None = None,
        pending: PendingInputs | None = None,
        host: HostCopy | None = None,
    ) -> None:
        self._result = result if isinstance(result, StepResult) else None
        self._read = None if isinstance(result, StepResult) else result
        self._read_observer: Callable[[], None] | None = None  # ``on_read_back``'s observer
        # Aligned with `plan.sample_rows`, on the runner's device; None when nothing was sampled.
        self.sampled = sampled
        # ``sampled``'s host copy (``sampled_copy``), queued with the step: given, or made here.
        self.host = host if host is not None or sampled is None else sampled_copy(sampled)
        # [num layers, num routed experts] token counts (on the runner's device), when the runner counts them.
        self.expert_counts = expert_counts
        self.num_rows_computed = num_rows_computed
        # Per planned request (plan order): its ids and the last token it sampled this step, −1 for none
        # (a non-final chunk, an error), on the device. What async scheduling's next step reads for its
        # pending inputs.
        self.request_ids = request_ids if request_ids is not None else []
        self.last_token_ids = last_token_ids
        # Speculative decoding: the next step's pending inputs, drafts and rejected rows included (built with
        # the step's result, which the speculator reads back on the host anyway).
        self._pending = pending
        # The prompt rows' logprobs the engine asked for (``PromptRows``), on the device; None: none asked.
        self.prompt_logprobs: PromptLogprobs | None = None

    @property
    def result(self) -> StepResult:
        if self._result is None:
            assert self._read is not None
            if self._read_observer is not None:
                self._read_observer()
            self._result, self._read = self._read(), None
        return self._result

    def on_read_back(self, observer: Callable[[], None]) -> bool:
        """Has ``observer`` called once, just before ``result`` is read back from the device (its first access),
        replacing any observer set before. Returns False, and never calls it, when there is nothing to read back:
        the result was given on the host, or has been read already."""
        if self._read is None:
            return False
        self._read_observer = observer
        return True

    def sampled_on_host(self) -> SamplerOutput | None:
        """``sampled`` on the host (waits for this step's copies, not for any step queued after it)."""
        return None if self.host is None else host_sampled(self.host)

    def pending_inputs(self) -> PendingInputs:
        """This step's sampled tokens as the next step's pending inputs."""
        if self._pending is not None:
            return self._pending
        tokens = self.last_token_ids if self.last_token_ids is not None else torch.full((len(self.request_ids),), -1)
        return PendingInputs(self.request_ids, tokens)
