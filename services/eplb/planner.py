"""The online planner's state, free of I/O: load reports in, versioned layer plans out.

Reports from all ranks for a step are mapped to logical experts (through the layout each rank ran) and
summed; a step is complete when every rank has reported it. Completed steps fill a sliding window per
layer. Re-plans are due after ``interval // 4`` completed steps, then every ``interval`` (DeepInfer's early
first re-plan against cold-start imbalance). Plan versions increase by one per applied layer plan.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from services.eplb.guarded import PlanConfig, plan_validated
from services.eplb.layout import Layout, startup_layout
from services.eplb.messages import LoadReport, MessageError, PlanMessage
from services.eplb.simulate import first_replan


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """What the planner plans for and how often."""

    num_logical: int  # logical experts per MoE layer
    num_gpus: int  # expert-parallel size
    num_redundant: int  # at least this many extra copies per layer (rounded up to divide by GPUs)
    num_layers: int  # MoE layers in every report
    num_ranks: int = 1  # engine ranks whose reports together make one step
    interval: int = 10_000  # completed steps between re-plans; the first comes at interval // 4
    window: int = 1_000  # latest completed steps each re-plan uses
    holdout: int = 0  # of those, the latest steps a guarded candidate must first win on (0: none)
    plan: PlanConfig = PlanConfig()  # policy, guard threshold, local search
    max_pending_steps: int = 64  # incomplete steps kept; past that the oldest is dropped as lost

    def __post_init__(self) -> None:
        for name in ("num_logical", "num_gpus", "num_layers", "num_ranks", "interval", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be ≥ 1, got {getattr(self, name)}")
        if not 0 <= self.holdout < self.window:
            raise ValueError(f"holdout must be in [0, window), got {self.holdout}")


@dataclasses.dataclass
class _PendingStep:
    """A step some ranks have reported."""

    ranks: set[int]  # ranks reported so far
    load: np.ndarray  # [layer, logical expert] tokens summed over those ranks


@dataclasses.dataclass(frozen=True)
class ReplanOutcome:
    """What one re-plan over all layers decided."""

    plans: list[PlanMessage]  # applied layer plans, to publish in order
    num_rejected: int  # layers whose candidate the guard refused
    moe_lb: dict[int, float]  # layer → moe_lb of the layout now in force, on its planning window


class Planner:
    def __init__(self, config: PlannerConfig) -> None:
        self.config = config
        start = startup_layout(config.num_logical, config.num_gpus, config.num_redundant)
        # Per layer, (version, layout) in version order; version 0 is the start-up layout.
        self._history: list[list[tuple[int, Layout]]] = [[(0, start)] for _ in range(config.num_layers)]
        self._windows: list[deque[np.ndarray]] = [deque(maxlen=config.window) for _ in range(config.num_layers)]
        self._pending: dict[int, _PendingStep] = {}
        self._done: deque[int] = deque(maxlen=4 * config.max_pending_steps)  # recently completed steps
        self.num_completed = 0
        self.version = 0
        self.num_dropped_steps = 0

    @property
    def num_slots(self) -> int:
        return self._history[0][0][1].num_slots

    def layout(self, layer: int, version: int | None = None) -> Layout:
        """Layout of ``layer`` under plan ``version`` (the newest plan for the layer not after it)."""
        for v, layout in reversed(self._history[layer]):
            if version is None or v <= version:
                return layout
        raise MessageError(f"plan version {version} of layer {layer} is older than the plans kept")

    def _logical(self, report: LoadReport) -> np.ndarray:
        load = np.zeros((self.config.num_layers, self.config.num_logical))
        for layer in range(self.config.num_layers):
            phy2log = self.layout(layer, report.plan_version).array()
            np.add.at(load[layer], phy2log, report.counts[layer])
        return load

    def add(self, report: LoadReport) -> bool:
        """Takes one report; returns whether a re-plan is due (call ``replan``). Raises MessageError."""
        expected = (self.config.num_layers, self.num_slots)
        if report.counts.shape != expected:
            raise MessageError(f"report counts are {report.counts.shape}, expected layers × slots {expected}")
        if not 0 <= report.rank < self.config.num_ranks:
            raise MessageError(f"rank {report.rank} outside 0..{self.config.num_ranks - 1}")
        if report.plan_version > self.version:
            raise MessageError(f"plan_version {report.plan_version} is newer than any plan ({self.version})")
        if report.step in self._done:
            return False
        pending = self._pending.get(report.step)
        if pending is None:
            if len(self._pending) >= self.config.max_pending_steps:
                del self._pending[min(self._pending)]
                self.num_dropped_steps += 1
            pending = self._pending[report.step] = _PendingStep(set(), np.zeros(0))
        if report.rank in pending.ranks:
            return False
        load = self._logical(report)
        pending.load = load if not pending.ranks else pending.load + load
        pending.ranks.add(report.rank)
        if len(pending.ranks) < self.config.num_ranks:
            return False
        del self._pending[report.step]
        self._done.append(report.step)
        for layer in range(self.config.num_layers):
            self._windows[layer].append(pending.load[layer])
        self.num_completed += 1
        first = first_replan(self.config.interval)
        return self.num_completed >= first and (self.num_completed - first) % self.config.interval == 0

    def replan(self) -> ReplanOutcome:
        """Plans every layer from its window; applied plans get the next versions."""
        plans: list[PlanMessage] = []
        moe_lbs: dict[int, float] = {}
        num_rejected = 0
        for layer in range(self.config.num_layers):
            window = np.stack(self._windows[layer]) if self._windows[layer] else None
            if window is None:
                continue
            current = self.layout(layer)
            result = plan_validated(window, current, self.config.plan, self.config.holdout)
            moe_lbs[layer] = result.moe_lb_after
            if not result.applied:
                num_rejected += 1
                continue
            if result.layout == current:
                continue  # a plan that changes nothing is not worth a version
            self.version += 1
            self._history[layer] = (self._history[layer] + [(self.version, result.layout)])[-16:]
            plans.append(
                PlanMessage(
                    self.version,
                    layer,
                    self.num_completed,
                    result.layout,
                    result.moe_lb_before,
                    result.moe_lb_after,
                    result.moves,
                    result.bytes_moved,
                )
            )
        return ReplanOutcome(plans, num_rejected, moe_lbs)
