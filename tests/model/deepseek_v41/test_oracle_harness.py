"""The oracle comparison itself must be able to fail: wrong models, untraced and traced differences."""

from __future__ import annotations

import copy

import pytest
import torch

from model.deepseek_v41 import quant
from tests import tolerances as tol
from tests.model.deepseek_v41 import quant_boundary

pytest.importorskip("nemo_automodel")

from tests.model.deepseek_v41.oracle_harness import (  # noqa: E402
    QuantCall,
    Recording,
    assert_matches,
    compare,
    run_both,
)


def test_a_wrong_sink_in_one_layer_fails(oracle_cases):
    built = oracle_cases["oracle"]
    wrong = copy.deepcopy(built.ours)
    with torch.no_grad():
        wrong.layers[3].attn.attn_sink.add_(0.05)
    _, _, comparison = run_both(wrong, built.nemo, built.ids)
    with pytest.raises(AssertionError):
        assert_matches(comparison, "perturbed")


def test_a_wrong_topk_tie_break_is_reported(oracle_cases, monkeypatch):
    import model.deepseek_v41.indexer as indexer

    built = oracle_cases["oracle"]

    def worst_first(scores, k):  # picks the lowest scores instead
        return torch.sort(scores, dim=-1, descending=False, stable=True).indices[..., : min(k, scores.shape[-1])]

    monkeypatch.setattr(indexer, "top_indices", worst_first)
    _, _, comparison = run_both(built.ours, built.nemo, built.ids)
    assert comparison.untraced


def _fp8_call(x: torch.Tensor) -> QuantCall:
    return QuantCall("fp8", x, quant.fake_quant_fp8_e4m3(x))


def test_flip_at_a_rounding_boundary_is_traced_and_exempts_downstream():
    seq = 10
    base = torch.linspace(-3, 3, 32).repeat(1, seq, 1)  # [1, S, 32]; amax 3 → scale 2^-7
    ours, nemo = base.clone(), base.clone()
    # 1.0625·... sits half-way between two e4m3 codes at this scale: a 1e-7 nudge flips it.
    boundary = (1.0 + 1.125) / 2
    ours[0, 6, 5] = boundary - 1e-7
    nemo[0, 6, 5] = boundary + 1e-7
    assert float(quant_boundary.fp8_boundary_distance(ours)[0, 6, 5]) <= tol.FLIP_BOUNDARY_TOL
    logits = torch.zeros(1, seq, 5)
    c = compare(
        logits,
        logits + 0.5 * (torch.arange(seq) >= 6).view(1, seq, 1),
        Recording(quant=[_fp8_call(ours)]),
        Recording(quant=[_fp8_call(nemo)]),
        seq,
    )
    assert c.untraced == [] and len(c.flips) == 1
    assert c.exempt[0].tolist() == [False] * 6 + [True] * 4
    assert c.max_abs_diff == 0.0


def test_difference_away_from_a_boundary_is_untraced():
    seq = 10
    x = torch.linspace(-3, 3, 32).repeat(1, seq, 1)
    wrong = _fp8_call(x)
    wrong.after[0, 2, 7] += 0.25
    logits = torch.zeros(1, seq, 5)
    c = compare(logits, logits, Recording(quant=[wrong]), Recording(quant=[_fp8_call(x)]), seq)
    assert c.untraced and not c.flips
