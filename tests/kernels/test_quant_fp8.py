"""``quant_fp8.swiglu_quant`` against ``reference.swiglu_quant`` (the clamped SwiGLU, the route weight, then
``quantize_act``): interpreted on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted

E4M3_STEP = 2.0**-3
"""e4m3's relative spacing (3 mantissa bits) for normal values; subnormals are multiples of 2^-9 of the scale."""


def _gate_up(num_rows: int, inter: int, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    gate_up = torch.randn(num_rows, 2 * inter, generator=gen, device=device) * 4
    gate_up[0, :inter] = 50.0  # above the limit: the gate clamps
    gate_up[1, inter:] = -50.0  # the up clamps from below
    return gate_up.to(torch.bfloat16)


def _check(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The kernel's SwiGLU (g / (1 + e^-g)) and torch's silu may differ in an fp32 ulp, which can move an e4m3 code
    across a rounding boundary (one e4m3 step) or a group's amax across a power of two (the group's scale doubles,
    its codes halve); nothing else may differ."""
    (q, s), (q_ref, s_ref) = got, want
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    scale_ok = (s == s_ref).float().mean().item()
    assert scale_ok >= 0.99, f"{1 - scale_ok:.3%} of the groups changed scale"
    deq = (q.float().unflatten(-1, (-1, reference.GROUP)) * s.unsqueeze(-1)).flatten(-2)
    deq_ref = (q_ref.float().unflatten(-1, (-1, reference.GROUP)) * s_ref.unsqueeze(-1)).flatten(-2)
    big = torch.maximum(s, s_ref).repeat_interleave(reference.GROUP, -1)
    bound = E4M3_STEP * torch.maximum(deq.abs(), deq_ref.abs()) + big * 2.0**-9
    assert ((deq - deq_ref).abs() <= bound).all()
    assert (q.view(torch.uint8) != q_ref.view(torch.uint8)).float().mean().item() <= 0.01


@pytest.mark.parametrize("num_rows", [3, 21])
def test_swiglu_quant_interpreted_matches_the_reference(num_rows):
    gen = torch.Generator().manual_seed(num_rows)
    inter = 256
    gate_up = _gate_up(num_rows, inter, gen)
    route_w = torch.rand(num_rows, generator=gen)
    route_w[-1] = 0.0  # a slot of weight 0 (a padded or dead one) quantises to zeros
    quant = load_interpreted("quant_fp8")
    with interpreter():
        got = quant.swiglu_quant(gate_up, route_w, 10.0)
    want = reference.swiglu_quant(gate_up, route_w, 10.0)
    _check(got, want)
    assert not got[0][-1].float().any()


def test_swiglu_quant_reads_a_strided_view_and_rejects_bad_widths():
    gen = torch.Generator().manual_seed(7)
    wide = _gate_up(5, 256, gen)
    view = torch.cat((wide, wide), 1)[:, :512]  # row stride 1024, unit column stride
    route_w = torch.rand(5, generator=gen)
    quant = load_interpreted("quant_fp8")
    with interpreter():
        got = quant.swiglu_quant(view, route_w, 10.0)
        with pytest.raises(ValueError, match="multiple of 128"):
            quant.swiglu_quant(wide[:, :192], route_w, 10.0)
        with pytest.raises(ValueError, match="route_w"):
            quant.swiglu_quant(wide, route_w[:4], 10.0)
    _check(got, reference.swiglu_quant(wide, route_w, 10.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_swiglu_quant_matches_the_reference():
    from kernels.quant_fp8 import swiglu_quant

    gen = torch.Generator(device="cuda").manual_seed(3)
    gate_up = _gate_up(4099, 2304, gen, "cuda")  # v41-s1's intermediate, a ragged last row block
    route_w = torch.rand(4099, generator=gen, device="cuda")
    _check(swiglu_quant(gate_up, route_w, 10.0), reference.swiglu_quant(gate_up, route_w, 10.0))
