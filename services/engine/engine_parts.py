"""What an engine's components share: the scheduler, the worker and the configuration, which may be replaced on the
engine, and the per-engine state that lives as long as it does (the live requests, structured output, the prefix
cache's hash chains, the penalties' history slots).

Each component reads the replaceable three here at each use, so a part set on the engine later (``Engine.worker``
wrapped by the expert-load publisher, a test's recording scheduler, a configuration replaced between rounds) is the
one every component calls next. The per-engine state is never replaced: a component may keep a reference to it."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_rs import Scheduler
from services.engine.config import EngineConfig
from services.engine.history_slots import HistorySlots
from services.engine.live_request import LiveRequest
from services.engine.prefix.request_hashes import RequestHashes
from services.engine.step_worker import StepWorker
from services.engine.structured.structured_output import StructuredOutput


@dataclass
class EngineParts:
    # scheduler_rs's scheduler: plans the steps, applies their results, holds the pools.
    scheduler: Scheduler
    # What runs the steps: the in-process Worker, a worker process, or a wrapper of either.
    worker: StepWorker
    # The engine's settings (read each step: async_scheduling may be switched between steps with none in flight).
    config: EngineConfig
    # The engine's live requests by the scheduler's request id (an n > 1 request's prefix and choices each have one).
    requests: dict[str, LiveRequest]
    # Structured output: constraints checked, the grammar gate, the step's token bitmask, the matchers' advance.
    structured: StructuredOutput
    # Prefix caching: each live request's block hash chain, given to the scheduler (None: caching off).
    hashes: RequestHashes | None
    # The penalties' per-request history slots (the worker's token counts), taken at admission, given back at the end.
    histories: HistorySlots
