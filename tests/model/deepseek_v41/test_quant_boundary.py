"""quant_boundary.py: distances to the cache formats' rounding discontinuities."""

import pytest
import torch

from model.deepseek_v41 import quant as Q
from tests.model.deepseek_v41 import quant_boundary as B


def _rand(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Per-row magnitudes spread over decades, so scales differ between blocks.
    return torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 3, (*shape[:-1], 1), generator=g)


def test_boundary_distance_zero_at_ties_and_exact_off_ties():
    x = torch.zeros(1, 32)
    x[0, :3] = torch.tensor([4.5, 2.5, 1.1])  # scale 1: 2.5 is a midpoint, 1.1 is 0.15 from 1.25
    d = B.fp4_boundary_distance(x, 32, "e8m0")
    assert d[0, 1] == 0.0
    assert d[0, 2] == pytest.approx(0.15, abs=1e-6)
    assert d[0, 0] == pytest.approx(0.5)  # 4.5 is 0.5 from the midpoint 5.0; the scale steps at 3 and 6
    # amax 6 sits exactly on the power-of-two scale step (6·2^0): the whole block is at distance 0.
    x[0, 0] = 6.0
    assert (B.fp4_boundary_distance(x, 32, "e8m0") == 0).all()
    y = torch.zeros(1, 32)
    y[0, 0], y[0, 1] = 448.0 * 0.75, 100.0  # scale 1; 100 lies between e4m3 96 and 104 → boundary 100
    assert B.fp8_boundary_distance(y)[0, 1] == 0.0
    y[0, 1] = 101.0
    assert B.fp8_boundary_distance(y)[0, 1] == pytest.approx(1.0)


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_perturbations_below_the_distance_never_flip(fmt):
    x = _rand(64, 64, seed=12)
    fq, dist = {
        "fp8": (lambda t: Q.fake_quant_fp8_e4m3(t, 32), lambda t: B.fp8_boundary_distance(t, 32)),
        "mxfp4": (Q.fake_quant_indexer, lambda t: B.fp4_boundary_distance(t, 32, "e8m0")),
        "nvfp4": (Q.fake_quant_compressed_kv, lambda t: B.fp4_boundary_distance(t, 16, "e4m3")),
    }[fmt]
    block = 16 if fmt == "nvfp4" else 32
    d = dist(x)
    assert (d >= 0).all()
    margin = d.unflatten(-1, (-1, block)).amin(-1, keepdim=True).expand(-1, -1, block).flatten(-2)
    g = torch.Generator().manual_seed(13)
    sign = torch.randint(0, 2, x.shape, generator=g) * 2 - 1
    assert torch.equal(fq(x + 0.45 * margin * sign), fq(x))
    assert d.min() < d.max()


def test_push_just_past_the_distance_flips():
    x = torch.zeros(1, 32)
    x[0, :2] = torch.tensor([6.0 * 0.75, 1.1])  # scale 1; 1.1 → 1.0, its boundary 1.25 is 0.15 away
    d = B.fp4_boundary_distance(x, 32, "e8m0")[0, 1].item()
    assert Q.fake_quant_indexer(x)[0, 1] == 1.0
    x[0, 1] += 0.99 * d
    assert Q.fake_quant_indexer(x)[0, 1] == 1.0
    x[0, 1] += 0.02 * d
    assert Q.fake_quant_indexer(x)[0, 1] == 1.5
    amax_case = torch.zeros(1, 32)
    amax_case[0, :2] = torch.tensor([5.9, 1.5])  # scale 1 until amax passes 6, then 2
    d_block = B.fp4_boundary_distance(amax_case, 32, "e8m0")[0, 1].item()
    assert d_block == pytest.approx(0.1, abs=1e-6)  # its own bin edges are 0.25 away
    amax_case[0, 0] += 0.99 * d_block
    assert Q.fake_quant_indexer(amax_case)[0, 1] == 1.5
    amax_case[0, 0] += 0.02 * d_block
    assert Q.fake_quant_indexer(amax_case)[0, 1] == 2.0  # 1.5 / 2 = 0.75 is a tie → 1.0 (even)
