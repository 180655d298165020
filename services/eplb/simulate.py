"""Replaying a recorded load trace under each planning mode, and a drifting Zipf trace to replay.

A mode runs the start-up layout, and at each re-plan step plans from the last ``window`` steps seen; the
result (applied or not) governs the steps that follow. Re-plans come every ``interval`` steps, the first
at ``interval // 4`` (DeepInfer's early re-plan against cold-start imbalance). ``static`` never re-plans.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from services.eplb.guarded import PlanConfig, plan_validated
from services.eplb.layout import Layout, gpu_loads, startup_layout

MODES = ("static", "deepinfer", "deepseek", "guarded")


def first_replan(interval: int) -> int:
    """Steps seen before the first re-plan: a quarter interval, at least 1."""
    if interval < 1:
        raise ValueError(f"interval must be ≥ 1, got {interval}")
    return max(1, interval // 4)


def replan_steps(num_steps: int, interval: int) -> list[int]:
    """Steps before which a re-plan runs: ``first_replan``, then every ``interval``."""
    return list(range(first_replan(interval), num_steps, interval))


def zipf_drift_trace(
    *,
    num_experts: int,
    num_steps: int,
    tokens_per_step: int,
    exponent: float = 1.0,
    drift: float = 0.05,
    seed: int = 0,
) -> np.ndarray:
    """``steps × experts`` token counts: Zipf popularity over a random ranking, drifting over time.

    Each expert's log-popularity takes a Gaussian random-walk step of size ``drift`` per step, so which
    experts are hot changes slowly; each step's counts are a multinomial draw of ``tokens_per_step``.
    """
    if num_experts < 1 or num_steps < 1 or tokens_per_step < 0 or drift < 0:
        raise ValueError("need num_experts ≥ 1, num_steps ≥ 1, tokens_per_step ≥ 0, drift ≥ 0")
    rng = np.random.default_rng(seed)
    ranks = rng.permutation(num_experts) + 1
    log_pop = -exponent * np.log(ranks.astype(np.float64))
    walk = np.cumsum(rng.normal(0.0, drift, size=(num_steps, num_experts)), axis=0)
    logits = log_pop[None, :] + walk
    probs = np.exp(logits - logits.max(axis=1, keepdims=True))
    probs /= probs.sum(axis=1, keepdims=True)
    return np.stack([rng.multinomial(tokens_per_step, p) for p in probs]).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class Replan:
    """One re-plan during a simulation."""

    step: int  # first step the resulting layout governs
    applied: bool  # whether the layout changed
    moves: int  # slots whose expert changed
    moe_lb_before: float  # old layout on the planning window
    moe_lb_after: float  # layout kept or applied, on the planning window


@dataclasses.dataclass(frozen=True)
class ModeRun:
    """One mode's replay of a trace."""

    mode: str  # one of MODES
    peak: np.ndarray  # [step] busiest GPU's tokens under the layout in force
    mean: np.ndarray  # [step] mean GPU tokens (the same for every mode)
    replans: list[Replan]  # in step order; empty for "static"

    def moe_lb(self, start: int = 0, stop: int | None = None) -> float:
        """Σ busiest / Σ mean over steps [start, stop): the walkthrough's formula over that span."""
        denominator = float(self.mean[start:stop].sum())
        return float(self.peak[start:stop].sum()) / denominator if denominator > 0 else 1.0

    def series(self, block: int) -> list[tuple[int, float]]:
        """moe_lb over consecutive blocks of ``block`` steps, as (first step, value)."""
        return [(s, self.moe_lb(s, s + block)) for s in range(0, len(self.peak), block)]

    @property
    def total_moves(self) -> int:
        return sum(r.moves for r in self.replans)

    def summary(self) -> dict:
        return {
            "mode": self.mode,
            "moe_lb": self.moe_lb(),
            "replans": len(self.replans),
            "applied": sum(r.applied for r in self.replans),
            "total_moves": self.total_moves,
            "moves_per_replan": self.total_moves / len(self.replans) if self.replans else 0.0,
        }


def _account(trace: np.ndarray, layout: Layout, start: int, stop: int, peak: np.ndarray, mean: np.ndarray) -> None:
    per_gpu = gpu_loads(trace[start:stop], layout)
    peak[start:stop] = per_gpu.max(axis=1)
    mean[start:stop] = per_gpu.mean(axis=1)


def run_mode(
    trace: np.ndarray,
    mode: str,
    *,
    num_gpus: int,
    num_redundant: int,
    interval: int,
    window: int,
    config: PlanConfig = PlanConfig(),
    holdout: int = 0,
    on_replan: Callable[[], None] | None = None,
) -> ModeRun:
    """Replays ``trace`` under ``mode``. ``holdout`` > 0 makes guarded re-plans validate on the window's
    latest steps before refitting (``plan_validated``); DeepInfer and DeepSeek modes ignore it."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
    if window < 1 or holdout < 0 or holdout >= window:
        raise ValueError(f"need window ≥ 1 and 0 ≤ holdout < window, got window {window}, holdout {holdout}")
    trace = np.asarray(trace, dtype=np.float64)
    num_steps, num_logical = trace.shape
    layout = startup_layout(num_logical, num_gpus, num_redundant)
    peak, mean = np.zeros(num_steps), np.zeros(num_steps)
    replans: list[Replan] = []
    points = [] if mode == "static" else replan_steps(num_steps, interval)
    mode_config = dataclasses.replace(config, policy="guarded" if mode == "static" else mode)
    start = 0
    for step in points:
        _account(trace, layout, start, step, peak, mean)
        seen = trace[max(0, step - window) : step]
        result = plan_validated(seen, layout, mode_config, holdout)
        replans.append(Replan(step, result.applied, result.moves, result.moe_lb_before, result.moe_lb_after))
        layout, start = result.layout, step
        if on_replan is not None:
            on_replan()
    _account(trace, layout, start, num_steps, peak, mean)
    return ModeRun(mode, peak, mean, replans)


def plot_runs(runs: Sequence[ModeRun], block: int, path: str) -> None:
    """Writes a small PNG: moe_lb per block of steps, and moves per re-plan, for each mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7.5, 5.0), sharex=True, height_ratios=(3, 2))
    styles = {
        "static": ("tab:gray", "-"),
        "deepinfer": ("tab:red", "-"),
        "deepseek": ("tab:green", "-"),
        "guarded": ("tab:blue", "-"),
    }
    for run in runs:
        color, line = styles.get(run.mode, ("black", "-"))
        xs, ys = zip(*run.series(block))
        top.plot(xs, ys, line, color=color, lw=1.2, label=f"{run.mode}: moe_lb {run.moe_lb():.3f} over the trace")
        if run.replans:
            bottom.plot(
                [r.step for r in run.replans],
                [r.moves for r in run.replans],
                "o-",
                color=color,
                ms=3,
                lw=0.8,
                label=f"{run.mode} ({run.total_moves} moves)",
            )
    replanned = [v for run in runs if run.mode != "static" for _, v in run.series(block)]
    if replanned and any(run.mode == "static" for run in runs):
        # Never re-planning sits far above; clip it so the re-planning modes stay readable.
        top.set_ylim(min(1.0, min(replanned)) - 0.01, max(replanned) + 0.05)
    top.set_ylabel(f"moe_lb per {block} steps")
    top.legend(fontsize=8)
    top.grid(alpha=0.3)
    bottom.set_ylabel("experts moved")
    bottom.set_xlabel("step")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)
