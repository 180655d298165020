"""MoE router kernel vs ``kernels.reference.moe_router`` (itself checked against the model's MoE.route
in test_moe_grouped_gemm.py): interpreted on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from tests.kernels.interpret import interpreter, load_interpreted
from tests.tolerances import FP32_REORDER_REL


def _problem(num_tokens: int, num_experts: int, hidden: int, gen: torch.Generator):
    x = torch.randn(num_tokens, hidden, generator=gen, device=gen.device).to(torch.bfloat16)
    gate = torch.randn(num_experts, hidden, generator=gen, device=gen.device) * 0.05
    bias = torch.randn(num_experts, generator=gen, device=gen.device) * 0.1
    return x, gate, bias


@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_router_interpreted_matches_reference(gate_dtype):
    gen = torch.Generator().manual_seed(0)
    x, gate, bias = _problem(21, 12, 96, gen)
    gate = gate.to(gate_dtype)
    x[3] = -40.0  # large negative logits: softplus → e^x, where a naive log(1 + e^x) loses it
    with interpreter():
        weights, experts = load_interpreted("moe_router").moe_router(x, gate, bias, 3, 1.5)
    r_weights, r_experts = reference.moe_router(x, gate, bias, 3, 1.5)
    assert torch.equal(experts, r_experts)
    torch.testing.assert_close(weights, r_weights, rtol=FP32_REORDER_REL, atol=1e-6)


def test_router_split_over_d_matches_reference_at_every_split():
    """Decode has one token tile: the D range is split over programs and a finishing kernel adds the
    partial logits in split order. Every split (and the default) routes like the reference."""
    gen = torch.Generator().manual_seed(2)
    x, gate, bias = _problem(5, 12, 640, gen)  # 5 D tiles of 128
    mr = load_interpreted("moe_router")
    r_weights, r_experts = reference.moe_router(x, gate, bias, 3, 1.5)
    with interpreter():
        runs = {split: mr.moe_router(x, gate, bias, 3, 1.5, split=split) for split in (1, 2, 3, 5, None)}
    for split, (weights, experts) in runs.items():
        assert torch.equal(experts, r_experts), split
        torch.testing.assert_close(weights, r_weights, rtol=FP32_REORDER_REL, atol=1e-6)
    assert mr.default_split(1, 40, 132) == 20 and mr.default_split(16, 40, 132) == 8
    assert mr.default_split(66, 40, 132) == 1 and mr.default_split(1, 1, 132) == 1


def test_router_interpreted_breaks_ties_towards_the_lower_id():
    gen = torch.Generator().manual_seed(1)
    x, gate, bias = _problem(4, 8, 64, gen)
    gate[5] = gate[2]  # experts 2 and 5 score the same for every token
    bias[5] = bias[2]
    bias[2] += 10.0
    bias[5] += 10.0  # ... and both beat everyone else
    with interpreter():
        _, experts = load_interpreted("moe_router").moe_router(x, gate, bias, 2, 1.0)
    assert experts[:, 0].tolist() == [2] * 4 and experts[:, 1].tolist() == [5] * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 256])
@pytest.mark.parametrize("gate_dtype", [torch.float32, torch.bfloat16])
def test_router_gpu_matches_reference_at_s1_shapes(num_tokens, gate_dtype):
    from kernels.moe_router import moe_router

    gen = torch.Generator("cuda").manual_seed(num_tokens)
    x, gate, bias = _problem(num_tokens, 48, 5120, gen)
    gate = gate.to(gate_dtype)
    weights, experts = moe_router(x, gate, bias, 6, 1.5)
    r_weights, r_experts = reference.moe_router(x, gate, bias, 6, 1.5)
    assert torch.equal(experts, r_experts)
    torch.testing.assert_close(weights, r_weights, rtol=FP32_REORDER_REL, atol=1e-6)
