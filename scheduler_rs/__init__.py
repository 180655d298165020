"""Shinkai's scheduler and block manager, written in Rust (``scheduler_rs._core``).

DeepInfer's semantics with its numbers as defaults (ARCHITECTURE.md §3). The engine loop is
``plan = scheduler.schedule()`` → run the plan → ``scheduler.update(plan, result)``.
"""

from scheduler_rs._core import (
    BlockManager,
    EngineType,
    FinishReason,
    Int32Array,
    MtpVarlen,
    PreemptionMode,
    RequestOutput,
    RequestState,
    Scheduler,
    SchedulerConfig,
    SchedulerStats,
    StepPlan,
    StepResult,
    VarlenPlan,
    graph_sizes,
    select_graph_size,
)

__all__ = [
    "BlockManager",
    "EngineType",
    "FinishReason",
    "Int32Array",
    "MtpVarlen",
    "PreemptionMode",
    "RequestOutput",
    "RequestState",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepPlan",
    "StepResult",
    "VarlenPlan",
    "graph_sizes",
    "select_graph_size",
]
