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


def _rotated_by_a_copy(x: torch.Tensor, angles: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The rotation as it was written before the pairs were read in place: a contiguous fp32 copy of the
    rotated channels, multiplied by the turns (the reference for the bits)."""
    rot = angles.shape[-1] * 2
    pairs = torch.view_as_complex(x[..., -rot:].float().unflatten(-1, (-1, 2)).contiguous())
    turn = angles if angles.is_complex() else rope_turns(angles)
    if x.ndim == angles.ndim + 1:
        turn = turn.unsqueeze(-2)
    if inverse:
        turn = turn.conj()
    return torch.view_as_real(pairs * turn).flatten(-2).to(x.dtype)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """t's values in a layout with an odd row stride (its pairs do not view as complex)."""
    wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=t.dtype)
    wide[..., 1:] = t
    return wide[..., 1:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(3, 4, 512), (3, 4, 96), (7, 512), (3, 4, 66)])
@pytest.mark.parametrize("layout", ["contiguous", "odd stride"])
@pytest.mark.parametrize("turns", [False, True])
def test_pairs_read_in_place_give_the_bits_of_a_copy(dtype, shape, layout, turns):
    """``_rotated`` multiplies the pairs where they lie and ``apply_rope_`` multiplies them in place (fp32):
    the same elementwise complex products as the contiguous copy's, so the same bits, for x with and without
    heads, v41's 512 channels, and layouts whose pairs must be copied (the odd stride)."""
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(*shape, generator=gen) * 10).to(dtype)
    if layout == "odd stride":
        x = _strided(x)
    angles = torch.rand(shape[0], 32, generator=gen) * 1000  # P = 32: v41's 64 rotated channels
    if len(shape) == 2:
        angles = angles[:, :16]
    angles = rope_turns(angles) if turns else angles
    rot = angles.shape[-1] * 2
    for inverse in (False, True):
        want = torch.cat((x[..., :-rot], _rotated_by_a_copy(x, angles, inverse)), dim=-1)
        assert torch.equal(apply_rope(x, angles, inverse=inverse), want)
    y = x.clone() if layout == "contiguous" else _strided(x)
    assert torch.equal(apply_rope_(y, angles), torch.cat((x[..., :-rot], _rotated_by_a_copy(x, angles, False)), -1))


def test_fp32_in_place_rotation_is_one_multiply():
    """fp32 pairs that view as complex are rotated by one launch (the multiply), with no copy in or out."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.__name__.split(".")[0])
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 4, 512)
    turns = rope_turns(torch.rand(3, 32) * 100)
    with Ops() as ops:
        apply_rope_(x, turns)
    moves = [n for n in ops.names if n not in ("unsqueeze", "slice", "view", "view_as_complex", "unflatten")]
    assert moves == ["mul_"], ops.names
