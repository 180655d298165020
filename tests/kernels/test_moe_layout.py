"""kernels/moe_layout.py against the torch layout (``KernelMoE._layout`` = ``reference.route_metadata``
over the stacked experts): every output equal, bit for bit, with and without a live mask."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from services.worker.kernel_model.moe import KernelMoE


def _choices(num_tokens: int, num_experts: int, top_k: int, seed: int, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    experts = torch.rand(num_tokens, num_experts, generator=gen, device=device).argsort(-1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=gen, device=device)
    return experts.to(torch.int32), weights


def torch_layout(experts, weights, num_experts, live):
    """``KernelMoE``'s torch path: its ``_layout`` (shared expert stacked last; dead rows to sinks, then
    cut) and the counts its forward adds, the specification the kernel must reproduce."""
    rows = None if live is None else live.reshape(-1, 1)
    meta = KernelMoE._layout(SimpleNamespace(num_experts=num_experts), experts, weights, rows)
    picks = torch.ones_like(experts, dtype=torch.long) if rows is None else rows.long().expand(experts.shape)
    counts = torch.zeros(num_experts, dtype=torch.long, device=experts.device)
    counts.scatter_add_(0, experts.flatten().long(), picks.flatten())
    return meta, counts


def _check(got, got_counts, want, want_counts):
    assert set(got) == set(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert torch.equal(got_counts, want_counts)


@pytest.mark.parametrize(
    ("num_tokens", "num_experts", "top_k", "with_live"),
    [
        (1, 8, 2, False),
        (5, 8, 2, True),
        (37, 16, 6, False),
        (37, 16, 6, True),
        (20, 48, 6, True),
        (3, 8, 2, "none live"),
    ],
)
def test_layout_equals_the_torch_layout_interpreted(num_tokens, num_experts, top_k, with_live):
    mod = load_interpreted("moe_layout")
    experts, weights = _choices(num_tokens, num_experts, top_k, seed=num_tokens)
    live = None
    if with_live:
        live = torch.rand(num_tokens, generator=torch.Generator().manual_seed(7)) < 0.6
        if with_live == "none live":
            live[:] = False
    want, want_counts = torch_layout(experts, weights, num_experts, live)
    counts = torch.full((num_experts,), 3, dtype=torch.long)  # adds to what is there
    with interpreter():
        got = mod.moe_layout(experts, weights, num_experts, live, counts)
    _check(got, counts - 3, want, want_counts)


def test_layout_refuses_prefill_sizes_and_bad_shapes():
    mod = load_interpreted("moe_layout")
    experts, weights = _choices(4, 8, 2, seed=0)
    with pytest.raises(ValueError, match="differ"):
        mod.moe_layout(experts, weights[:, :1], 8)
    big, big_w = _choices(mod.MAX_TOKENS + 1, 8, 2, seed=0)
    with pytest.raises(ValueError, match="decode steps"):
        mod.moe_layout(big, big_w, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 1024])
def test_gpu_layout_equals_the_torch_layout_at_v41_shapes(num_tokens):
    from kernels.moe_layout import moe_layout

    experts, weights = _choices(num_tokens, 48, 6, seed=num_tokens, device="cuda")
    for live in (None, torch.rand(num_tokens, device="cuda") < 0.5):
        want, want_counts = torch_layout(experts, weights, 48, live)
        counts = torch.zeros(48, dtype=torch.long, device="cuda")
        got = moe_layout(experts, weights, 48, live, counts)
        _check(got, counts, want, want_counts)
