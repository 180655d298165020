"""kernels/moe_combine.py: the dead-row zeros and the leading-columns width it writes are
``torch.where(live, combine(y)[:, :width], 0.0)``'s bits (what ``KernelMoE`` did after it)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _problem(num_tokens: int, dim: int, k: int, device: str = "cpu") -> tuple[torch.Tensor, ...]:
    """y [E, cap, D] bf16 with NaN in slot 0 (where a dead row's picks point), slot_of [T, k], live [T]."""
    gen = torch.Generator(device=device).manual_seed(num_tokens + dim + k)
    num_experts, capacity = 5, num_tokens + 1
    y = torch.randn(num_experts, capacity, dim, generator=gen, device=device).to(torch.bfloat16)
    y.view(-1, dim)[0] = float("nan")
    slot_of = torch.randint(1, num_experts * capacity, (num_tokens, k), generator=gen, device=device)
    live = torch.rand(num_tokens, generator=gen, device=device) < 0.6
    live[0], live[-1] = False, True
    slot_of[~live] = 0  # dead rows gather slot 0 (any bytes)
    return y, slot_of, live


def _check(combine, y, slot_of, live, width, shared_last):
    full = combine(y, slot_of, shared_last)
    want = torch.where(live.unsqueeze(-1), full[:, :width], 0.0)
    got = combine(y, slot_of, shared_last, live=live, width=width)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # the bits, +0.0 in the dead rows
    bits = lambda t: t.contiguous().view(torch.int32)  # noqa: E731  (NaN rows compare by their bits)
    # Live rows only: a dead row's NaN payload is not part of any contract (it may differ on the GPU).
    assert torch.equal(bits(full[live]), bits(reference.moe_combine(y, slot_of, shared_last)[live]))
    assert torch.equal(bits(combine(y, slot_of, shared_last, width=width)), bits(full[:, :width]))
    assert torch.isnan(full[0]).all() and not torch.isnan(got).any()


@pytest.mark.parametrize(("num_tokens", "dim", "width"), [(6, 128, 64), (4, 600, 600), (3, 1100, 520)])
@pytest.mark.parametrize("shared_last", [False, True])
def test_interpreted_live_rows_and_width_are_where_of_the_slice(num_tokens, dim, width, shared_last):
    mod = load_interpreted("moe_combine")
    y, slot_of, live = _problem(num_tokens, dim, 3)
    with interpreter():
        _check(mod.moe_combine, y, slot_of, live, width, shared_last)
        with pytest.raises(ValueError, match="width"):
            mod.moe_combine(y, slot_of, live=live, width=dim + 1)
        with pytest.raises(ValueError, match="live"):
            mod.moe_combine(y, slot_of, live=live[:-1])


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(("num_tokens", "dim", "width"), [(8, 4096, 4096), (256, 7168, 7168), (5, 256, 64)])
def test_gpu_live_rows_and_width_are_where_of_the_slice(num_tokens, dim, width):
    from kernels.moe_combine import moe_combine

    y, slot_of, live = _problem(num_tokens, dim, 7, device="cuda")
    _check(moe_combine, y, slot_of, live, width, True)
