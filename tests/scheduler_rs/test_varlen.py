import pytest

from scheduler_rs import MtpVarlen

# Pass 3, "Choosing how many drafts to check": four requests, nextn 3, cumulative confidences.
WXYZ = [[0.95, 0.90, 0.80], [0.85, 0.60, 0.30], [0.50, 0.20, 0.10], [0.30, 0.10, 0.05]]


def test_walkthrough_chooses_eight_rows_w_w_x_w():
    plan = MtpVarlen({4: 8.1, 8: 8.6, 16: 12.0}, sampler_ms=0.4).choose(WXYZ)
    assert plan.num_rows == 8
    assert plan.num_drafts == [3, 1, 0, 0]
    assert plan.tokens_per_ms == pytest.approx(7.5 / 9.0)


def test_a_cheaper_sixteen_row_graph_checks_every_draft():
    plan = MtpVarlen({4: 8.1, 8: 8.6, 16: 10.4}, sampler_ms=0.4).choose(WXYZ)
    assert (plan.num_rows, plan.num_drafts) == (16, [3, 3, 3, 3])
    assert plan.tokens_per_ms == pytest.approx(9.65 / 10.8)  # a float64 sum of 12 terms: ≤ 12·2^-53 relative


def test_bad_curves_and_confidences_are_rejected():
    with pytest.raises(ValueError, match="empty"):
        MtpVarlen({})
    with pytest.raises(ValueError, match="not in"):
        MtpVarlen({4: 1.0}).choose([[1.2]])
