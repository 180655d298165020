"""Planning entry points: DeepInfer's and DeepSeek's policies as they run, and the guarded planner.

DeepInfer applies whatever its greedy policy returns (walkthrough Pass 3 "When greedy makes it worse":
1.057 → 1.114), and so does DeepSeek's reference. The guarded planner (``optimise``) takes candidates from
every policy and from the current layout, improves them by local search, and picks the fewest moves among
those within ``tolerance`` of the best moe_lb found. It applies that pick only if it beats the current
layout by ``threshold`` on the planning window and, when given, on a held-out later window. A rejected
plan leaves the current layout untouched.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from services.eplb.deepseek import deepseek_plan
from services.eplb.layout import (
    V41_EXPERT_BYTES,
    Layout,
    check_load,
    count_moves,
    moe_lb,
)
from services.eplb.optimise import Point, SearchConfig, candidates, choose, tradeoff
from services.eplb.policy import deepinfer_plan

POLICIES = ("deepinfer", "deepseek", "guarded")


@dataclasses.dataclass(frozen=True)
class PlanConfig:
    """Knobs of the planner; the defaults are what the CLI and the service use."""

    policy: str = "guarded"  # "deepinfer" or "deepseek" (apply unchecked, as they do) or "guarded"
    threshold: float = 0.01  # least drop in moe_lb for a guarded plan to apply, on each scored window
    tolerance: float = 0.002  # guarded: moe_lb above the best found that is still worth saving moves for
    num_groups: int = 1  # DeepSeek's expert groups; hierarchical when num_nodes divides it
    num_nodes: int = 1  # DeepSeek's nodes; 1 with 1 group is its global policy
    local_search: bool = True  # polish guarded candidates with swaps and re-targeting
    max_passes: int = 5  # local-search passes per start (5 keeps 256 experts / 64 GPUs / 1000 steps under 1 s)
    expert_bytes: int = V41_EXPERT_BYTES  # weight bytes one move copies (one expert of one layer)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("threshold", "tolerance"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number ≥ 0, got {value!r}")
        if self.num_groups < 1 or self.num_nodes < 1 or self.max_passes < 0:
            raise ValueError(
                f"need num_groups, num_nodes ≥ 1 and max_passes ≥ 0, got {self.num_groups}, "
                f"{self.num_nodes}, {self.max_passes}"
            )
        if self.expert_bytes < 0:
            raise ValueError(f"expert_bytes must be ≥ 0, got {self.expert_bytes}")


@dataclasses.dataclass(frozen=True)
class PlanResult:
    """One planning decision for one layer."""

    policy: str  # which policy decided
    layout: Layout  # the layout to run from now on: the candidate if applied, else the current one
    candidate: Layout  # what the policy proposed (after min-move relabelling for guarded)
    source: str  # where the candidate came from ("deepseek+search", "current", …; the policy otherwise)
    applied: bool  # whether ``layout`` is the candidate
    moe_lb_before: float  # current layout on the planning window
    moe_lb_candidate: float  # candidate on the planning window
    moe_lb_after: float  # ``layout`` on the planning window
    holdout_before: float | None  # current layout on the held-out window; None without one
    holdout_candidate: float | None  # candidate on the held-out window; None without one
    moves: int  # slots whose expert changes from the current layout to ``layout``
    candidate_moves: int  # slots the candidate would change, applied or not
    bytes_moved: int  # ``moves`` × bytes per expert
    reason: str  # one line on why it was applied or rejected
    tradeoff: tuple[Point, ...] = ()  # guarded: the (moe_lb, moves) Pareto front it saw, by moves

    def to_dict(self) -> dict:
        return {
            "policy": self.policy,
            "source": self.source,
            "applied": self.applied,
            "reason": self.reason,
            "moe_lb_before": self.moe_lb_before,
            "moe_lb_candidate": self.moe_lb_candidate,
            "moe_lb_after": self.moe_lb_after,
            "holdout_before": self.holdout_before,
            "holdout_candidate": self.holdout_candidate,
            "moves": self.moves,
            "candidate_moves": self.candidate_moves,
            "bytes_moved": self.bytes_moved,
            "tradeoff": [p.to_dict() for p in self.tradeoff],
            "layout": self.layout.to_dict(),
            "candidate": self.candidate.to_dict(),
        }


def search_config(config: PlanConfig) -> SearchConfig:
    return SearchConfig(
        tolerance=config.tolerance,
        local_search=config.local_search,
        max_passes=config.max_passes,
        num_groups=config.num_groups,
        num_nodes=config.num_nodes,
    )


def plan(
    load: np.ndarray, current: Layout, config: PlanConfig = PlanConfig(), holdout: np.ndarray | None = None
) -> PlanResult:
    """Plans one layer from a ``steps × experts`` window against the layout now in use."""
    load = check_load(load, current.num_logical)
    if holdout is not None:
        holdout = check_load(holdout, current.num_logical)
    front: tuple[Point, ...] = ()
    source = config.policy
    if config.policy == "deepinfer":
        candidate = deepinfer_plan(load, current.num_gpus, current.num_slots)
    elif config.policy == "deepseek":
        candidate = deepseek_plan(
            load, current.num_gpus, current.num_slots, num_groups=config.num_groups, num_nodes=config.num_nodes
        )
    else:
        points = candidates(load, current, search_config(config))
        chosen, candidate = choose(points, current, config.tolerance)
        source, front = chosen.source, tuple(tradeoff(points))
    before, after = moe_lb(load, current), moe_lb(load, candidate)
    h_before = None if holdout is None else moe_lb(holdout, current)
    h_after = None if holdout is None else moe_lb(holdout, candidate)
    if config.policy != "guarded":
        applied, reason = True, f"{config.policy} applies every plan unchecked"
    elif candidate == current:
        applied, reason = (
            False,
            (
                f"the current layout is within {config.tolerance} of the best found "
                f"({front[-1].moe_lb:.4f}): nothing to move"
            ),
        )
    elif before - after < config.threshold:
        applied, reason = False, f"gain {before - after:.4f} on the window is below {config.threshold}"
    elif h_before is not None and h_after is not None and h_before - h_after < config.threshold:
        applied, reason = False, f"gain {h_before - h_after:.4f} on the held-out window is below {config.threshold}"
    else:
        applied, reason = True, f"gain {before - after:.4f} ≥ {config.threshold}"
    layout = candidate if applied else current
    moves = count_moves(current, layout)
    return PlanResult(
        policy=config.policy,
        layout=layout,
        candidate=candidate,
        source=source,
        applied=applied,
        moe_lb_before=before,
        moe_lb_candidate=after,
        moe_lb_after=moe_lb(load, layout),
        holdout_before=h_before,
        holdout_candidate=h_after,
        moves=moves,
        candidate_moves=count_moves(current, candidate),
        bytes_moved=moves * config.expert_bytes,
        reason=reason,
        tradeoff=front,
    )


def plan_validated(
    window: np.ndarray, current: Layout, config: PlanConfig = PlanConfig(), holdout_steps: int = 0
) -> PlanResult:
    """Validate, then refit: the online form of the held-out guard.

    A candidate fitted on the window without its latest ``holdout_steps`` must beat the current layout on
    those steps (a fair test: neither layout was fitted on them); only then is the plan refitted on the
    whole window, and applied if it also passes the window guard. A candidate always looks better on the
    steps it was fitted to, so without this, stationary load churns layouts on sampling noise. DeepInfer
    and DeepSeek modes, and windows no longer than ``holdout_steps``, plan once from the whole window.
    """
    window = check_load(window, current.num_logical)
    if config.policy != "guarded" or holdout_steps <= 0 or len(window) <= holdout_steps:
        return plan(window, current, config)
    check = plan(window[:-holdout_steps], current, config, holdout=window[-holdout_steps:])
    if not check.applied:
        return check
    final = plan(window, current, config)
    return dataclasses.replace(final, holdout_before=check.holdout_before, holdout_candidate=check.holdout_candidate)
