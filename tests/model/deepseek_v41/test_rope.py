"""rope.py: the in-place rotation writes what ``apply_rope`` returns, and only the rotated channels."""

import pytest
import torch

from model.deepseek_v41.rope import apply_rope, apply_rope_


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
    assert torch.allclose(apply_rope(y, angles, inverse=True).float(), x.float(), atol=0.05 if dtype == torch.bfloat16
                          else 1e-5)
