"""The measured step-cost curve of varlen verification, one per request bucket: the non-decreasing per-size means
joined by lines once two sizes are measured, proportional to rows below the one size measured and flat above it,
flat before any decode step of the bucket."""

from __future__ import annotations

import pytest

from services.engine.step_cost import MIN_STEP_MS, StepCostMeter

SIZES = [1, 2, 4, 8, 16, 24]


def test_flat_before_a_step_and_a_refit_every_interval():
    meter = StepCostMeter(SIZES, refit_interval=3)
    assert meter.curve() == {s: 1.0 for s in SIZES} and not meter.measured()  # a guess
    assert [meter.record(8, 5.0) for _ in range(6)] == [False, False, True, False, False, True]


def test_one_size_gives_a_curve_proportional_to_rows_below_it_and_flat_above():
    meter = StepCostMeter(SIZES)
    meter.record(8, 4.0)
    meter.record(8, 6.0)  # mean 5 ms at 8 rows
    assert meter.curve() == {s: 5.0 * min(s, 8) / 8 for s in SIZES}
    assert not meter.measured()  # a guess: it must not stop the draft (StepPlan.propose_drafts)


def test_one_size_at_the_smallest_still_lets_a_likely_draft_be_verified():
    """Batch 1 after steps whose drafts had confidence 0 measured only size 1: a draft with confidence 0.8 must
    still get a row (1.8 tokens for the step's cost), or no second size is ever measured."""
    meter = StepCostMeter(SIZES)
    meter.record(1, 12.0)
    curve = meter.curve()
    assert (1 + 0.8) / curve[2] > 1 / curve[1]


def test_two_sizes_or_more_join_the_means_and_stay_flat_past_the_largest():
    meter = StepCostMeter(SIZES)
    for size, ms in ((4, 7.0), (4, 9.0), (16, 14.0), (24, 18.0)):  # means: 8 at 4, 14 at 16, 18 at 24
        meter.record(size, ms)
    curve = meter.curve()
    assert meter.measured()
    # Through (4, 8), (16, 14), (24, 18): slope 0.5 up to 16 (continued below 4), then 0.5 again up to 24.
    assert curve == pytest.approx({1: 6.5, 2: 7.0, 4: 8.0, 8: 10.0, 16: 14.0, 24: 18.0})
    meter = StepCostMeter(SIZES + [48])
    for size, ms in ((1, 12.0), (16, 24.0), (24, 28.0)):
        meter.record(size, ms)
    assert meter.curve()[48] == pytest.approx(28.0)  # past the largest measured size: flat, so it is tried


def test_a_bend_is_kept_where_one_line_would_spread_it():
    """Steps measured at batch 1 (1-8 rows: each row reads more experts, about 1.4 ms a row here) and at batch 16 (16-48
    rows, past the bend, as measured on the GPU: docs/speculative.md). One line through all the means had a slope of
    0.57 ms a row here, so for 16 requests at a = 0.8 varlen stopped at 48 rows; the curve through the means prices
    the rows past 48 at what was measured (nothing yet: flat, so tried), and varlen verifies every draft."""
    from scheduler_rs import MtpVarlen, graph_sizes

    sizes = graph_sizes(16 * 6, 8)
    meter = StepCostMeter(sizes)
    for size, ms in ((1, 12.5), (2, 14.5), (4, 18.0), (8, 22.5), (16, 24.0), (24, 31.0), (32, 36.0), (48, 39.5)):
        meter.record(size, ms)
    curve = meter.curve()
    assert curve[16] == 24.0 and curve[40] == pytest.approx(37.75) and curve[96] == 39.5
    confidences = [[0.8 ** (j + 1) for j in range(5)] for _ in range(16)]
    assert MtpVarlen(curve).choose(confidences).num_rows == 96
    meter.record(96, 41.7)  # measured: still worth it (16 · 3.69 tokens in 41.7 ms against 16 · 2.44 in 39.5)
    assert MtpVarlen(meter.curve()).choose(confidences).num_rows == 96


def test_the_curve_never_falls_with_rows_nor_below_the_floor():
    meter = StepCostMeter(SIZES)
    meter.record(1, 9.0)
    meter.record(24, 3.0)  # noise: the bigger step measured faster
    curve = meter.curve()
    assert len(set(curve.values())) == 1  # the two pooled: their mean, 6 ms, everywhere
    assert curve[1] == pytest.approx(6.0)
    meter = StepCostMeter(SIZES)
    for size, ms in ((1, 5.0), (4, 9.0), (8, 8.0), (8, 8.0), (16, 12.0)):  # 4 rows slower than 8: pooled
        meter.record(size, ms)
    curve = meter.curve()
    assert all(curve[a] <= curve[b] for a, b in zip(SIZES, SIZES[1:]))
    assert curve[16] == pytest.approx(12.0) and curve[1] == pytest.approx(5.0)
    meter = StepCostMeter([1, 2])
    meter.record(2, MIN_STEP_MS / 10)
    assert meter.curve()[1] == MIN_STEP_MS


BATCH_64_MEANS = {
    4: (21.022, 1),
    8: (23.489, 6),
    16: (29.802, 7),
    24: (33.813, 2),
    32: (39.982, 2),
    40: (41.834, 1),
    56: (45.768, 1),
    64: (42.729, 132),
    72: (63.561, 2),
    80: (50.863, 1),
    88: (62.016, 1),
    96: (59.966, 5),
    104: (66.797, 1),
    112: (66.603, 3),
    120: (67.51, 4),
    128: (67.619, 16),
    136: (63.739, 1),
    160: (73.959, 21),
    168: (75.063, 1),
    192: (78.463, 31),
    208: (81.028, 1),
    256: (86.178, 16),
    320: (97.749, 5),
    344: (101.242, 1),
    352: (101.53, 1),
    384: (106.273, 37),
}
"""Measured step means (ms, steps) per graph size after an engine ran batch 64 at a = 0.8, 1, 0.5 and 0
(v41-s1, varlen; docs/results/speculative-v41-varlen.json): the curve its batch-16 cases started from."""


def test_each_request_bucket_has_its_own_curve():
    """Batch 16 after batch 64 on one engine. One curve for both priced batch 16's rows past
    64 by batch 64's steps (96 rows cost more at 64 requests than at 16), so varlen at a = 0.8 verified 80
    rows, not the 96 that pay at batch 16's own times; per bucket it verifies all 96 and batch 64 keeps its price."""
    from scheduler_rs import MtpVarlen, graph_sizes

    sizes = graph_sizes(64 * 6, 8)
    shared, meter = StepCostMeter(sizes), StepCostMeter(sizes, refit_interval=10_000)
    for size, (ms, n) in BATCH_64_MEANS.items():
        for _ in range(n):
            shared.record(size, ms)
            assert meter.record(size, ms, num_requests=64) is False
    assert meter.record(64, 43.3, num_requests=16) is True  # the bucket changed: the scheduler needs 16's curve
    shared.record(64, 43.3)
    for size, ms, n in ((64, 43.3, 19), (96, 49.9, 28)):
        for _ in range(n):
            shared.record(size, ms)
            assert meter.record(size, ms, num_requests=16) is False
    confidences = [[0.8 ** (j + 1) for j in range(5)] for _ in range(16)]
    assert MtpVarlen(shared.curve()).choose(confidences).num_rows == 80
    assert MtpVarlen(meter.curve(16)).choose(confidences).num_rows == 96
    assert meter.curve(16)[96] == pytest.approx(49.9) and meter.curve(64)[96] > 59.9  # 88 and 96 pooled there
    assert meter.curve(9) == meter.curve(16) and meter.curve(17) == {s: 1.0 for s in sizes}  # 32's: no step yet
    assert meter.measured(16) and meter.measured(64) and not meter.measured(1)
    assert list(meter.all_means()) == [16, 64] and meter.means(16) == {
        64: pytest.approx((43.3, 20)),
        96: pytest.approx((49.9, 28)),
    }


def test_request_buckets_are_powers_of_two():
    from services.engine.step_cost import request_bucket

    assert [request_bucket(n) for n in (0, 1, 2, 3, 4, 5, 16, 17, 64, 256)] == [1, 1, 2, 4, 4, 8, 16, 32, 64, 256]


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="at least one graph size"):
        StepCostMeter([])
    with pytest.raises(ValueError, match="refit_interval"):
        StepCostMeter(SIZES, refit_interval=0)
