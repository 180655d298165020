"""An engine's expert-load reports to the EPLB planner (`subjects.EXPERT_LOAD`, `services/eplb/messages.py`).

`ExpertLoadPublisher` wraps the engine's worker (composition: the same ``execute``, ``launch``/``sample`` and
``release``) and, after every step whose runner counted tokens per expert, publishes that step's ``[layers,
experts]`` counts from the event loop's thread. A single engine applies no plans, so the layout is the start-up
one: physical slot = logical expert, ``plan_version`` 0. A data-parallel rank passes ``report`` instead: its
receiving side's counts per physical slot with the plan version in force (services/engine/parallel/live_plans.py),
taken after each (synchronous) step. Steps are numbered per engine from 0; publishing is best effort.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from observability import tracing
from services import subjects
from services.eplb.messages import LoadReport
from services.worker.host_copy import HostCopy
from services.worker.sampling.sampler import SamplingRow
from services.worker.worker_output import WorkerOutput

log = logging.getLogger("shinkai.engine.expert_loads")


class ExpertLoadPublisher:
    def __init__(
        self,
        worker: Any,
        nc: Any,
        loop: asyncio.AbstractEventLoop,
        rank: int,
        report: Callable[[int], LoadReport] | None = None,
        replica: str | None = None,
    ) -> None:
        self.worker = worker  # the wrapped worker (in-process or remote)
        self.nc = nc  # a connected nats.aio.client.Client; None: not yet (nothing is published)
        self.loop = loop  # the loop that owns ``nc``; execute runs on the step thread
        self.rank = rank  # this engine's rank in the planner's reports
        # Where the reports go: this engine's own subject of the family (None: the replica named by its rank).
        self.subject = subjects.of_replica(subjects.EXPERT_LOAD, replica or f"engine-{rank}")
        self.num_steps = 0  # steps executed, the report's step number
        self.num_published = 0
        # (step, its counts' host copy, queued with the step) not yet published: reading the device counts
        # after the next step is queued would wait for that step too (services/worker/host_copy.py).
        self._held: tuple[int, HostCopy] | None = None
        self.report = report  # step → that step's report, taken after it (a rank); None: the runner's counts

    def execute(
        self, plan: Any, rows: Sequence[SamplingRow], *previous: WorkerOutput | None, **extra: Any
    ) -> WorkerOutput:
        """The wrapped worker's step. An async engine passes ``previous`` (the step in flight, or None): then
        this step's counts are held and published at the next call, after that step is queued, so reading
        them back never makes the host wait on the device (the engine reads that step then anyway); the
        counts of an async busy period's last step go out with the next step."""
        return self._counted(self.worker.execute(plan, rows, *previous, **extra), held=bool(previous))

    def launch(self, plan: Any, rows: Sequence[SamplingRow], *previous: WorkerOutput | None, **extra: Any) -> Any:
        """The wrapped worker's forward alone (an async engine with structured output); ``sample`` finishes the
        step, and its counts are taken there."""
        return self.worker.launch(plan, rows, *previous, **extra)

    def sample(self, step: Any, token_bitmask: Any = None) -> WorkerOutput:
        """The wrapped worker's sampling of a launched step; its counts are held as an async step's."""
        return self._counted(self.worker.sample(step, token_bitmask), held=True)

    def _counted(self, out: WorkerOutput, held: bool) -> WorkerOutput:
        """Publishes (or, ``held``, holds until the next step is queued) the step's expert counts."""
        if self.report is not None:  # a data-parallel rank: synchronous, its step is over
            report = self.report(self.num_steps)
            self.num_steps += 1
            self._send(report)
            return out
        self._publish_held()
        if out.expert_counts is not None:
            self._held = (self.num_steps, HostCopy([out.expert_counts]))
        self.num_steps += 1
        if not held:  # a synchronous engine: this step has been read back already
            self._publish_held()
        return out

    def _publish_held(self) -> None:
        if self._held is None:
            return
        step, copy = self._held
        self._held = None
        if self.nc is None:
            return
        self._send(LoadReport(rank=self.rank, step=step, plan_version=0, counts=copy.get()[0].numpy()))

    def _send(self, report: LoadReport) -> None:
        if self.nc is None:
            return
        # Taken here, on the step thread, where a traced step's span is current.
        headers = tracing.nats_headers()
        asyncio.run_coroutine_threadsafe(self._publish(report.encode(), headers), self.loop)

    async def _publish(self, data: bytes, headers: dict[str, str] | None = None) -> None:
        try:
            await self.nc.publish(self.subject, data, headers=headers)
            self.num_published += 1
        except Exception as err:  # NATS down: the engine keeps serving
            log.warning("expert-load report not published: %s", err)

    def release(self, request_id: str) -> None:
        self.worker.release(request_id)

    @property
    def in_process(self) -> bool:
        """The wrapped worker's: an in-process worker still takes the async and host extras (passed through)."""
        return self.worker.in_process

    @property
    def num_losses(self) -> int:
        """The wrapped worker's (``StepWorker.num_losses``): a restarted worker process still drops the cache."""
        return self.worker.num_losses

    def set_images(self, request_id: str, prompt_token_ids: list[int], rows: Any) -> None:
        """The wrapped worker's (Engine.provide_images): image embeddings pass through untouched."""
        self.worker.set_images(request_id, prompt_token_ids, rows)
