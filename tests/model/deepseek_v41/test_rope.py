"""rope.py: the in-place rotation writes what ``apply_rope`` returns, and only the rotated channels; turns
in place of angles give the same bits."""

import math

import pytest
import torch

from model.deepseek_v41.rope import apply_rope, apply_rope_, rope_turns
from tests.tolerances import U_BF16, U_FP32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(5, 3, 32), (5, 32)])
def test_in_place_rotation_equals_apply_rope(dtype, shape):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=gen).to(dtype)
    angles = torch.rand(5, 4, generator=gen) * 100  # P = 4: the last 8 channels rotate
    want = apply_rope(x, angles)
    y = x.clone()
    assert apply_rope_(y, angles) is y
    assert torch.equal(y, want)
    assert torch.equal(y[..., :-8], x[..., :-8]) and not torch.equal(y[..., -8:], x[..., -8:])
    # Rotating back: each rotation rounds its outputs (≤ u relative to the pair's norm ≤ √2·max|x|), and in
    # fp32 its products, its sum and cos² + sin² ≠ 1 add a few u more: ≤ 2·√2·u·max|x| in bf16 (x itself is
    # exact), ≤ 2·√2·5u·max|x| in fp32. Measured 0.5 u·max|x| (bf16) and 1.2 u·max|x| (fp32).
    u = U_BF16 if dtype == torch.bfloat16 else 5 * U_FP32
    back = apply_rope(y, angles, inverse=True).float()
    assert float((back - x.float()).abs().max()) <= 2 * math.sqrt(2) * u * float(x.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inverse", [False, True])
def test_turns_in_place_of_angles_give_the_same_bits(dtype, inverse):
    """A step passes ``rope_turns(angles)`` (computed once per frequency set) where layers passed angles."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 32, generator=gen).to(dtype)
    angles = torch.rand(5, 4, generator=gen) * 1000
    turns = rope_turns(angles)
    assert turns.is_complex() and turns.shape == angles.shape
    assert torch.equal(apply_rope(x, turns, inverse=inverse), apply_rope(x, angles, inverse=inverse))
    assert torch.equal(apply_rope_(x.clone(), turns), apply_rope_(x.clone(), angles))
    assert not torch.equal(apply_rope(x, turns), apply_rope(x, turns, inverse=True))  # the turns do rotate
    # The turns of angle 0 are exactly 1 + 0i (what AttentionStep passes where RoPE is already undone).
    assert torch.equal(rope_turns(torch.zeros(5, 4)), torch.ones(5, 4, dtype=torch.complex64))
