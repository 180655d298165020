"""The measured step-cost curve of varlen verification: a line through the per-size means once two sizes
are measured, proportional to rows below the one size measured and flat above it, flat before any decode
step."""

from __future__ import annotations

import pytest

from services.engine.step_cost import MIN_STEP_MS, StepCostMeter

SIZES = [1, 2, 4, 8, 16, 24]


def test_flat_before_a_step_and_a_refit_every_interval():
    meter = StepCostMeter(SIZES, refit_interval=3)
    assert meter.curve() == {s: 1.0 for s in SIZES} and not meter.measured  # a guess
    assert [meter.record(8, 5.0) for _ in range(6)] == [False, False, True, False, False, True]


def test_one_size_gives_a_curve_proportional_to_rows_below_it_and_flat_above():
    meter = StepCostMeter(SIZES)
    meter.record(8, 4.0)
    meter.record(8, 6.0)  # mean 5 ms at 8 rows
    assert meter.curve() == {s: 5.0 * min(s, 8) / 8 for s in SIZES}
    assert not meter.measured  # a guess: it must not stop the draft (StepPlan.propose_drafts)


def test_one_size_at_the_smallest_still_lets_a_likely_draft_be_verified():
    """Batch 1 after steps whose drafts had confidence 0 measured only size 1: a draft with confidence 0.8 must
    still get a row (1.8 tokens for the step's cost), or no second size is ever measured."""
    meter = StepCostMeter(SIZES)
    meter.record(1, 12.0)
    curve = meter.curve()
    assert (1 + 0.8) / curve[2] > 1 / curve[1]


def test_two_sizes_fit_the_line_through_the_means():
    meter = StepCostMeter(SIZES)
    for size, ms in ((4, 7.0), (4, 9.0), (16, 14.0), (24, 18.0)):  # means: 8 at 4, 14 at 16, 18 at 24
        meter.record(size, ms)
    curve = meter.curve()
    assert meter.measured
    # Least squares through (4, 8), (16, 14), (24, 18): b = 0.5, a = 6.
    assert curve == pytest.approx({s: 6.0 + 0.5 * s for s in SIZES})


def test_the_fit_never_falls_with_rows_nor_below_the_floor():
    meter = StepCostMeter(SIZES)
    meter.record(1, 9.0)
    meter.record(24, 3.0)  # noise: the bigger step measured faster
    curve = meter.curve()
    assert len(set(curve.values())) == 1  # slope clamped to 0: the mean, 6 ms, everywhere
    assert curve[1] == pytest.approx(6.0)
    meter = StepCostMeter([1, 2])
    meter.record(2, MIN_STEP_MS / 10)
    assert meter.curve()[1] == MIN_STEP_MS


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one graph size"):
        StepCostMeter([])
    with pytest.raises(ValueError, match="refit_interval"):
        StepCostMeter(SIZES, refit_interval=0)
