"""What an engine steps: the in-process ``Worker`` (services/worker/worker.py), ``RemoteWorker`` (a worker process
over ``worker.v1``), or a wrapper of either (``ExpertLoadPublisher``)."""

from __future__ import annotations

from typing import Any, Protocol

from services.worker.worker_output import WorkerOutput


class StepWorker(Protocol):
    @property
    def in_process(self) -> bool:
        """The worker runs in this process: its ``execute`` takes the step in flight (async scheduling), the
        prompt-logprob rows and the token mask, and its sampler keeps the penalties' token counts. False for a
        worker process, whose protocol does not carry them yet."""
        ...

    @property
    def num_losses(self) -> int:
        """How often the worker has lost its pools (a worker process restarted): 0 for the in-process worker. The
        engine drops its prefix cache when the count moves, so nothing resumes from memory that is gone."""
        ...

    def execute(self, plan: Any, rows: Any, *args: Any, **kwargs: Any) -> WorkerOutput:
        """Runs one step's plan with its sampling rows (the in-process worker takes the async and host extras)."""
        ...

    def launch(self, plan: Any, rows: Any, *args: Any, **kwargs: Any) -> Any:
        """The step's forward alone (async scheduling with structured output, so in-process workers only: a worker
        process is never asked): ``sample`` takes the step it returns and the token mask, filled meanwhile."""
        ...

    def sample(self, step: Any, token_bitmask: Any = None) -> WorkerOutput:
        """Samples a launched step (``launch``): the same output as ``execute``."""
        ...

    def release(self, request_id: str) -> None:
        """Gives back what the worker holds for the request (its slot's tokens, images, drafts)."""
        ...
