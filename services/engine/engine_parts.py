"""The parts of an engine that its components share: the scheduler, the worker and the configuration. Each component
reads them here at each use, so a part set on the engine later (``Engine.worker`` wrapped by the expert-load
publisher, a test's recording scheduler, a configuration replaced between rounds) is the one every component calls
next."""

from __future__ import annotations

from dataclasses import dataclass

from scheduler_rs import Scheduler
from services.engine.config import EngineConfig
from services.engine.step_worker import StepWorker


@dataclass
class EngineParts:
    # scheduler_rs's scheduler: plans the steps, applies their results, holds the pools.
    scheduler: Scheduler
    # What runs the steps: the in-process Worker, a worker process, or a wrapper of either.
    worker: StepWorker
    # The engine's settings (read each step: async_scheduling may be switched between steps with none in flight).
    config: EngineConfig
