"""The benchmark switch: each draft accepted independently with probability a (a leading run of successes)."""

import math

import pytest

from services.worker.spec.forced_acceptance import ForcedAcceptance


def test_the_extremes_accept_everything_or_nothing():
    assert [ForcedAcceptance(1.0).num_accepted(5) for _ in range(50)] == [5] * 50
    assert [ForcedAcceptance(0.0).num_accepted(5) for _ in range(50)] == [0] * 50
    assert ForcedAcceptance(0.8).num_accepted(0) == 0


def test_accepted_counts_follow_the_truncated_geometric_law():
    """P(m accepted of k) = a^m (1 − a) for m < k, a^k for m = k. 20,000 draws; each frequency within 4.5
    binomial standard deviations of its probability (a chance miss below 1e-4 over the six counts)."""
    a, k, n = 0.8, 5, 20_000
    forced = ForcedAcceptance(a, seed=3)
    counts = [0] * (k + 1)
    for _ in range(n):
        counts[forced.num_accepted(k)] += 1
    for m, count in enumerate(counts):
        p = a**m * (1 - a) if m < k else a**k
        assert abs(count / n - p) < 4.5 * math.sqrt(p * (1 - p) / n), (m, count / n, p)


def test_confidences_are_the_true_chances_and_bad_probabilities_are_refused():
    assert ForcedAcceptance(0.5).confidences(3) == [0.5, 0.25, 0.125]
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        ForcedAcceptance(1.5)
