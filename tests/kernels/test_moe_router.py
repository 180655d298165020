"""MoE router kernel vs ``kernels.reference.moe_router`` (itself checked against the model's MoE.route
in test_moe_grouped_gemm.py): interpreted on CPU, compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted
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


@pytest.mark.parametrize("num_tokens", [1, 21])
@pytest.mark.parametrize("with_image", [False, True])
def test_router_finishing_in_the_last_program_gives_the_second_launchs_bits(num_tokens, with_image):
    """The split partials summed and routed by the token tile's last program (one launch) against the same
    code in a finishing launch: the same weights' bits and experts, and every ticket counter 0 after."""
    from kernels import tickets

    gen = torch.Generator().manual_seed(num_tokens)
    x, gate, bias = _problem(num_tokens, 12, 640, gen)
    vl = {}
    if with_image:
        vl = {"bias_vl": torch.randn(12, generator=gen), "image": torch.rand(num_tokens, generator=gen) < 0.5}
    mr = load_interpreted("moe_router")
    launches = []
    with interpreter():
        for split in (2, 5):
            two = mr.moe_router(x, gate, bias, 3, 1.5, split=split, one_launch=False, **vl)
            # Another x first: the partial buffer a later call may be given then holds its partials, not x's,
            # so a program that routed before every split's partial was in would show.
            mr.moe_router(-x, gate, bias, 3, 1.5, split=split, **vl)
            one = mr.moe_router(x, gate, bias, 3, 1.5, split=split, **vl)
            assert torch.equal(one[0].view(torch.int32), two[0].view(torch.int32)) and torch.equal(one[1], two[1])
            launches.append(len(tickets._TICKETS))
    assert launches[-1] >= 1 and tickets.all_zero()


@pytest.mark.parametrize(("num_tokens", "split"), [(1, None), (5, 1), (16, 3), (21, 2)])
@pytest.mark.parametrize("one_launch", [True, False])
def test_router_layout_gives_the_router_then_layout_bytes(num_tokens, split, one_launch):
    """``moe_router_layout`` (the layout in the routing program up to one 16-row tile, its own launch above)
    against ``moe_router`` then ``moe_layout``: weights, experts, every metadata tensor and the expert counts
    the same bytes, with dead rows and without; buffers handed on hold another x's layout first."""
    gen = torch.Generator().manual_seed(num_tokens + 7)
    x, gate, bias = _problem(num_tokens, 12, 640, gen)
    live = torch.rand(num_tokens, generator=gen) < 0.7
    live[0] = True
    mr = load_interpreted("moe_router")
    with interpreter():
        for rows in (None, live):
            counts, counts_ref = torch.arange(12), torch.arange(12)
            mr.moe_router_layout(-x, gate, bias, 3, 1.5, None, None, split=split, one_launch=one_launch)
            weights, experts, meta = mr.moe_router_layout(
                x, gate, bias, 3, 1.5, rows, counts, split=split, one_launch=one_launch
            )
            r_weights, r_experts = mr.moe_router(x, gate, bias, 3, 1.5, split=split)
            r_meta = mr.moe_layout(r_experts, r_weights, 12, rows, counts_ref)
            assert torch.equal(weights.view(torch.int32), r_weights.view(torch.int32))
            assert torch.equal(experts, r_experts) and torch.equal(counts, counts_ref)
            assert meta.keys() == r_meta.keys()
            for key in meta:
                assert meta[key].dtype == r_meta[key].dtype and torch.equal(meta[key], r_meta[key]), key
    with pytest.raises(ValueError, match="live must be bool"):
        mr.moe_router_layout(x, gate, bias, 3, 1.5, live.int())


def _image_reference(x, gate, bias, bias_vl, image, top_k, route_scale):
    """The model's own route (model/deepseek_v41/moe.py), image tokens selecting with ``bias_vl``."""
    from model.deepseek_v41.moe import MoE

    moe = MoE.__new__(MoE)
    torch.nn.Module.__init__(moe)
    moe.top_k, moe.route_scale = top_k, route_scale
    moe.gate_weight, moe.gate_bias, moe.bias_vl = (torch.nn.Parameter(t) for t in (gate, bias, bias_vl))
    with torch.no_grad():
        return moe.route(x, image)


@pytest.mark.parametrize("split", [1, 3])
def test_router_interpreted_with_an_image_mask_selects_like_the_model(split):
    """Image tokens select with ``bias_vl`` (a bias far from the text one, so their picks change), text
    tokens in the same tile with the gate bias: the kernel's picks are the model's exactly, in one program
    and split over D; without a mask the kernel's output is unchanged."""
    gen = torch.Generator().manual_seed(3)
    x, gate, bias = _problem(21, 12, 384, gen)
    bias_vl = torch.randn(12, generator=gen) * 2.0
    image = torch.zeros(21, dtype=torch.bool)
    image[[0, 4, 5, 6, 17, 20]] = True
    mr = load_interpreted("moe_router")
    with interpreter():
        weights, experts = mr.moe_router(x, gate, bias, 3, 1.5, split=split, bias_vl=bias_vl, image=image)
        text_w, text_e = mr.moe_router(x, gate, bias, 3, 1.5, split=split)
    r_weights, r_experts = _image_reference(x, gate, bias, bias_vl, image, 3, 1.5)
    assert torch.equal(experts.long(), r_experts)
    torch.testing.assert_close(weights, r_weights, rtol=FP32_REORDER_REL, atol=1e-6)
    assert not torch.equal(experts[image], text_e[image])  # the mask changed the image tokens' picks
    assert torch.equal(experts[~image], text_e[~image]) and torch.equal(weights[~image], text_w[~image])
    t_weights, t_experts = reference.moe_router(x, gate, bias, 3, 1.5)
    assert torch.equal(text_e, t_experts)
    with pytest.raises(ValueError, match="both or neither"):
        mr.moe_router(x, gate, bias, 3, 1.5, image=image)
    with pytest.raises(ValueError, match="must be bool"):
        mr.moe_router(x, gate, bias, 3, 1.5, bias_vl=bias_vl, image=image.to(torch.int32))


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
    # The last program's finish (one launch) against the finishing launch: the same bits, every run.
    two = moe_router(x, gate, bias, 6, 1.5, one_launch=False)
    for _ in range(20):
        one = moe_router(x, gate, bias, 6, 1.5)
        assert torch.equal(one[0].view(torch.int32), two[0].view(torch.int32)) and torch.equal(one[1], two[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 256])
def test_router_gpu_with_an_image_mask_selects_like_the_model(num_tokens):
    from kernels.moe_router import moe_router

    gen = torch.Generator("cuda").manual_seed(num_tokens)
    x, gate, bias = _problem(num_tokens, 48, 5120, gen)
    bias_vl = torch.randn(48, generator=gen, device="cuda")
    image = torch.rand(num_tokens, generator=gen, device="cuda") < 0.5
    image[0] = True
    weights, experts = moe_router(x, gate, bias, 6, 1.5, bias_vl=bias_vl, image=image)
    r_weights, r_experts = _image_reference(x, gate, bias, bias_vl, image, 6, 1.5)
    assert torch.equal(experts.long(), r_experts)
    torch.testing.assert_close(weights, r_weights, rtol=FP32_REORDER_REL, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 16, 64])
def test_router_layout_gpu_gives_the_router_then_layout_bytes(num_tokens):
    """At the v41-s1 router (48 experts, D 5120, top-6): the layout in the routing program (T ≤ 16) or its
    own launch (64) against ``moe_router`` then ``moe_layout``, bytes equal, every run."""
    from kernels.moe_router import moe_layout, moe_router, moe_router_layout

    gen = torch.Generator("cuda").manual_seed(num_tokens)
    x, gate, bias = _problem(num_tokens, 48, 5120, gen)
    live = torch.rand(num_tokens, generator=gen, device="cuda") < 0.7
    live[0] = True
    counts_ref = torch.zeros(48, dtype=torch.int64, device="cuda")
    r_weights, r_experts = moe_router(x, gate, bias, 6, 1.5)
    r_meta = moe_layout(r_experts, r_weights, 48, live, counts_ref)
    for _ in range(10):
        counts = torch.zeros(48, dtype=torch.int64, device="cuda")
        weights, experts, meta = moe_router_layout(x, gate, bias, 6, 1.5, live, counts)
        assert torch.equal(weights.view(torch.int32), r_weights.view(torch.int32)) and torch.equal(experts, r_experts)
        assert torch.equal(counts, counts_ref) and all(torch.equal(meta[key], r_meta[key]) for key in r_meta)
