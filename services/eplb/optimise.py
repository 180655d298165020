"""The guarded planner's optimiser: the fewest moves among layouts within a tolerance of the best found.

Starts come from every policy (DeepInfer's with copies spread over GPUs, DeepSeek's reference) and from
the current layout. Each start is a candidate as it is, and so is its form without needless
co-locations; local search improves that form, and every layout on its path is a candidate, so a short
path is a cheap plan. Co-located copies of one expert do not change moe_lb under the even split, so a
start that has them (the reference often does) is not excluded: undoing a few swaps from it stays a few
moves. A policy's start keeps the policy's GPU order, so its search does not depend on the current
layout; a candidate's moves are counted after matching its start's GPUs to the current ones.
``choose`` returns the fewest moves within ``tolerance`` of the lowest moe_lb seen; ``tradeoff`` the
(moe_lb, moves) Pareto front.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from services.eplb.assignment import gpu_matching, group_counts, min_move_relabel, moves_under
from services.eplb.deepseek import deepseek_plan
from services.eplb.layout import Layout, count_moves, gpu_loads, needless_colocations
from services.eplb.policy import deepinfer_plan
from services.eplb.search import local_search_path, spread_out


@dataclasses.dataclass(frozen=True)
class Point:
    """One candidate layout the optimiser saw."""

    source: str  # where it came from: "current", "deepinfer", "deepseek", with "+spread" / "+search"
    phy2log: tuple[int, ...]  # the candidate's slots, in its start's GPU order (moe_lb ignores the order)
    moe_lb: float  # on the planning window
    moves: int  # experts to load after matching its GPUs to the current ones as its start's are matched

    def to_dict(self) -> dict:
        return {"source": self.source, "moe_lb": self.moe_lb, "moves": self.moves}


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """What the optimiser tries."""

    tolerance: float  # moe_lb above the best found that is still worth saving moves for
    local_search: bool  # improve every start by local search
    max_passes: int  # local-search passes per start
    num_groups: int  # DeepSeek's expert groups (1: its global policy)
    num_nodes: int  # DeepSeek's nodes (1: its global policy)


def _moe_lb(load: np.ndarray, layout: Layout, mean_sum: float) -> float:
    return float(gpu_loads(load, layout).max(axis=1).sum()) / mean_sum if mean_sum > 0 else 1.0


def _starts(load: np.ndarray, current: Layout, config: SearchConfig) -> list[tuple[str, Layout]]:
    """(source, layout) of each start, as its policy returns it (not relabelled, so that the searches from
    the policies' plans do not depend on the current layout: planning the result again finds the same)."""
    num_gpus, num_slots = current.num_gpus, current.num_slots
    return [
        ("current", current),
        ("deepinfer", deepinfer_plan(load, num_gpus, num_slots, spread=True)),
        (
            "deepseek",
            deepseek_plan(load, num_gpus, num_slots, num_groups=config.num_groups, num_nodes=config.num_nodes),
        ),
    ]


def candidates(load: np.ndarray, current: Layout, config: SearchConfig) -> list[Point]:
    """Every candidate: each start, its spread-out form, and each layout along the local-search path from
    that form. Duplicates (same slots) are kept once, first source wins. Only starts and their "+spread"
    forms may hold needless co-locations (local search never adds one)."""
    mean_sum = float(load.sum()) / current.num_gpus
    current_counts = group_counts(current.array(), current.num_gpus, current.num_logical)
    points: list[Point] = []
    seen: set[tuple[int, ...]] = set()

    for source, start in _starts(load, current, config):
        matched = current_counts[gpu_matching(start, current)]

        def add(name: str, phy2log: tuple[int, ...], value: float) -> None:
            if phy2log in seen:
                return
            seen.add(phy2log)
            points.append(Point(name, phy2log, value, moves_under(np.asarray(phy2log), matched)))

        add(source, start.phy2log, _moe_lb(load, start, mean_sum))
        spread = spread_out(start, load) if needless_colocations(start) else start
        add(f"{source}+spread", spread.phy2log, _moe_lb(load, spread, mean_sum))
        if config.local_search:
            for phy2log, score in local_search_path(spread, load, max_passes=config.max_passes)[1:]:
                add(f"{source}+search", phy2log, score / mean_sum if mean_sum > 0 else 1.0)
    return points


def choose(points: list[Point], current: Layout, tolerance: float) -> tuple[Point, Layout]:
    """The fewest moves among points within ``tolerance`` of the lowest moe_lb (then lower moe_lb, then
    candidate order), and its layout relabelled once more to move the fewest experts."""
    best = min(p.moe_lb for p in points)
    eligible = [p for p in points if p.moe_lb <= best + tolerance]
    chosen = min(eligible, key=lambda p: (p.moves, p.moe_lb))
    layout = min_move_relabel(Layout(chosen.phy2log, current.num_gpus, current.num_logical), current)
    return dataclasses.replace(chosen, phy2log=layout.phy2log, moves=count_moves(current, layout)), layout


def tradeoff(points: list[Point]) -> list[Point]:
    """The Pareto front: each point with lower moe_lb than every point with no more moves, by moves."""
    front: list[Point] = []
    for p in sorted(points, key=lambda p: (p.moves, p.moe_lb)):
        if not front or p.moe_lb < front[-1].moe_lb:
            front.append(p)
    return front
