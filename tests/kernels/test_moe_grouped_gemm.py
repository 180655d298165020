"""MoE FP8 grouped GEMM vs ``kernels.reference``: interpreted on CPU at small shapes, compiled on a GPU
at the v41-s1 shapes; the reference itself against the model's MoE layer."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from kernels.fp8_weights import convert_mxfp4_expert, quantize_weight_block128, stack_gate_up
from kernels.interpret import interpreter, load_interpreted
from tests.tolerances import BF16_TRUNC_REL, FP32_REORDER_REL


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    """Uniform random distinct top-k per token, on the generator's device."""
    experts = torch.rand(num_tokens, num_experts, generator=gen, device=gen.device).argsort(-1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=gen, device=gen.device)
    return reference.route_metadata(experts, weights, num_experts)


def _weights(num_experts: int, n: int, k: int, gen: torch.Generator):
    return quantize_weight_block128(torch.randn(num_experts, n, k, generator=gen, device=gen.device) * 0.05)


def _valid(out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The written slots of a masked [E, cap, N] output, stacked."""
    return torch.cat([out[e, : int(counts[e])] for e in range(out.shape[0])])


def _tie_activations(num_tokens: int, channels: int, gen: torch.Generator) -> torch.Tensor:
    """bf16 activations whose groups hit e4m3 rounding ties (normal and subnormal) at scale 1."""
    x = torch.randn(num_tokens, channels, generator=gen)
    x[:, 0::128] = 300.0  # group amax 300 → scale pow2_ceil(300/448) = 1
    x[:, 1::128] = 1.0625  # tie between 1.0 and 1.125 → 1.0 (even)
    x[:, 2::128] = 1.1875  # tie between 1.125 and 1.25 → 1.25 (even)
    x[:, 3::128] = 3 * 2.0**-10  # subnormal tie between 2^-9 and 2^-8 → 2^-8 (even)
    x[:, 4::128] = -(2.0**-11)  # below half the smallest subnormal → -0
    return x.to(torch.bfloat16)


def test_quantize_act_rounds_to_nearest_even_without_clipping():
    gen = torch.Generator().manual_seed(0)
    x = _tie_activations(3, 256, gen).float()
    q, scale = reference.quantize_act(x)
    assert torch.all(scale == 1.0)
    assert torch.all(q[:, 1].float() == 1.0) and torch.all(q[:, 2].float() == 1.25)
    assert torch.all(q[:, 3].float() == 2.0**-8) and torch.all(q[:, 4].float() == 0.0)
    y = torch.randn(4, 384, generator=gen) * 1e3
    q, scale = reference.quantize_act(y)
    assert torch.all(torch.log2(scale) == torch.log2(scale).round())  # powers of two
    assert torch.all(q.float().abs().unflatten(-1, (-1, 128)).amax(-1) <= 448)
    assert _rel(reference.dequantize_act(q, scale), y) < 0.04


def test_route_metadata_is_a_consistent_masked_layout():
    gen = torch.Generator().manual_seed(1)
    experts = torch.rand(9, 5, generator=gen).argsort(-1)[:, :2]
    weights = torch.rand(9, 2, generator=gen)
    meta = reference.route_metadata(experts, weights, 5)
    assert meta["counts"].tolist() == [int((experts == e).sum()) for e in range(5)]
    assert int(meta["num_active"]) == int((meta["counts"] > 0).sum())
    active = meta["active"][: int(meta["num_active"])].tolist()
    assert active == sorted(active) and all(meta["counts"][e] > 0 for e in active)
    for t in range(9):
        for s in range(2):
            e, j = divmod(int(meta["slot_of"][t, s]), 9)
            assert e == experts[t, s] and j < meta["counts"][e]
            assert meta["row_ids"][e, j] == t and meta["route_w"][e, j] == weights[t, s]


@pytest.mark.parametrize(("num_tokens", "block_m"), [(3, 16), (40, 16), (40, None)])
def test_gate_up_swiglu_interpreted_matches_reference(num_tokens, block_m):
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inter = 6, 256, 128
    meta = _routing(num_tokens, num_experts, 2, gen)
    w13, s13 = _weights(num_experts, 2 * inter, hidden, gen)
    x = _tie_activations(num_tokens, hidden, gen)
    mg = load_interpreted("moe_grouped_gemm")
    with interpreter():
        out = mg.moe_grouped_gemm(
            x, w13, s13, meta, gather=True, swiglu_limit=0.5, out_dtype=torch.float32, block_m=block_m
        )
    ref = reference.moe_grouped_gemm(
        x,
        w13,
        s13,
        meta["counts"],
        row_ids=meta["row_ids"],
        route_w=meta["route_w"],
        swiglu_limit=0.5,
        out_dtype=torch.float32,
    )
    assert _rel(_valid(out, meta["counts"]), _valid(ref, meta["counts"])) < FP32_REORDER_REL


def test_m_split_gives_the_same_bits_and_fills_a_one_expert_linear():
    """``m_split`` spreads an expert's token tiles over work items (prefill linears have too few N tiles to
    fill the GPU): every split gives the same output bits, for the fused SwiGLU with FP8 output and for a
    one-expert (dense linear) GEMM; the default splits only when the slabs alone cannot fill the programs."""
    from services.worker.kernel_model.fp8_linear import one_expert_meta

    gen = torch.Generator().manual_seed(3)
    mg = load_interpreted("moe_grouped_gemm")
    num_experts, hidden, inter = 4, 128, 128
    meta = _routing(70, num_experts, 2, gen)
    w13, s13 = _weights(num_experts, 2 * inter, hidden, gen)
    x = _tie_activations(70, hidden, gen)
    w, s = _weights(1, 256, 256, gen)
    dense = torch.randn(90, 256, generator=gen)
    with interpreter():
        fused = [
            mg.moe_grouped_gemm(
                x, w13, s13, meta, gather=True, swiglu_limit=0.5, out_dtype=torch.float8_e4m3fn, block_m=16, m_split=m
            )
            for m in (1, 2, 3)
        ]
        linear = [
            mg.moe_grouped_gemm(
                dense,
                w,
                s,
                one_expert_meta(90, 1, dense.device),
                gather=True,
                out_dtype=torch.float32,
                block_m=16,
                m_split=m,
            )
            for m in (1, 4, 6, 9)
        ]
    counts = meta["counts"]
    want_values, want_scales = (_valid(t, counts) for t in fused[0])  # slots ≥ counts are never written
    for values, scales in fused[1:]:
        assert torch.equal(_valid(values, counts).view(torch.uint8), want_values.view(torch.uint8))
        assert torch.equal(_valid(scales, counts), want_scales)
    for out in linear[1:]:
        assert torch.equal(out, linear[0])
    ref = reference.moe_grouped_gemm(
        dense,
        w,
        s,
        torch.tensor([90]),
        row_ids=torch.arange(90)[None],
        route_w=torch.ones(1, 90),
        out_dtype=torch.float32,
    )
    assert _rel(linear[0][0], ref[0]) < FP32_REORDER_REL
    assert mg.default_m_split(1764, 4, 264) == 1  # MoE: the slabs fill the programs
    assert mg.default_m_split(10, 1, 264) == 1  # decode: one M tile
    assert mg.default_m_split(10, 256, 264) == 27 and mg.default_m_split(4, 8, 264) == 8


def test_down_interpreted_matches_reference_and_skips_idle_experts():
    gen = torch.Generator().manual_seed(7)
    num_experts, hidden, inter = 8, 256, 256
    meta = _routing(3, num_experts, 2, gen)  # at most 6 of 8 experts have tokens
    assert int(meta["num_active"]) < num_experts
    w2, s2 = _weights(num_experts, hidden, inter, gen)
    h = (torch.randn(num_experts, 3, inter, generator=gen)).to(torch.bfloat16)
    mg = load_interpreted("moe_grouped_gemm")
    with interpreter():
        out = mg.moe_grouped_gemm(h, w2, s2, meta, gather=False, out_dtype=torch.float32, block_n=64)
        out_bf16 = mg.moe_grouped_gemm(h, w2, s2, meta, gather=False)
    ref = reference.moe_grouped_gemm(h, w2, s2, meta["counts"], out_dtype=torch.float32)
    assert _rel(_valid(out, meta["counts"]), _valid(ref, meta["counts"])) < FP32_REORDER_REL
    assert out_bf16.dtype == torch.bfloat16
    assert _rel(_valid(out_bf16, meta["counts"]), _valid(ref, meta["counts"])) < BF16_TRUNC_REL  # truncating casts


def test_quantize_act_kernel_interpreted_is_bit_exact_with_the_reference():
    gen = torch.Generator().manual_seed(5)
    x = _tie_activations(19, 384, gen)
    x[5, 128:256] = 0.0  # an all-zero group: code 0 with the smallest scale
    with interpreter():
        q, scale = load_interpreted("quant_fp8").quantize_act(x)
    r_q, r_scale = reference.quantize_act(x)
    assert torch.equal(scale, r_scale)
    assert torch.equal(q.view(torch.uint8), r_q.view(torch.uint8))  # bits: −0 stays −0


def test_prequantized_path_interpreted_matches_reference():
    """x quantised once, gate/up writes h as e4m3 + scales from fp32, down reads them."""
    gen = torch.Generator().manual_seed(9)
    num_experts, hidden, inter, num_tokens = 5, 256, 256, 12
    meta = _routing(num_tokens, num_experts, 2, gen)
    w13, s13 = _weights(num_experts, 2 * inter, hidden, gen)
    w2, s2 = _weights(num_experts, hidden, inter, gen)
    x = _tie_activations(num_tokens, hidden, gen)
    mg = load_interpreted("moe_grouped_gemm")
    kwargs = dict(swiglu_limit=0.5, out_dtype=torch.float8_e4m3fn)
    with interpreter():
        h_q, h_s = mg.moe_grouped_gemm(mg.quantize_act(x), w13, s13, meta, gather=True, **kwargs)
        y = mg.moe_grouped_gemm((h_q, h_s), w2, s2, meta, gather=False, out_dtype=torch.float32)
        out = mg.moe_experts(x, meta, w13, s13, w2, s2, 0.5)
    r_q, r_s = reference.moe_grouped_gemm(
        x, w13, s13, meta["counts"], row_ids=meta["row_ids"], route_w=meta["route_w"], **kwargs
    )
    counts = meta["counts"]
    assert torch.equal(_valid(h_s, counts), _valid(r_s, counts))
    # fp32 summation order may move a value across an e4m3 rounding boundary: a code may differ only as a
    # traced flip, the two codes neighbours and the reference's fp32 h within FP32_REORDER_REL·max|h| (its
    # row) of their midpoint. The scales are equal (above), so the midpoint is the codes' mean × scale.
    h32 = _valid(
        reference.moe_grouped_gemm(
            x,
            w13,
            s13,
            counts,
            row_ids=meta["row_ids"],
            route_w=meta["route_w"],
            swiglu_limit=0.5,
            out_dtype=torch.float32,
        ),
        counts,
    )
    ours, theirs = _valid(h_q, counts), _valid(r_q, counts)
    flipped = ours.float() != theirs.float()
    a, b = ours.view(torch.uint8).int(), theirs.view(torch.uint8).int()
    mag_a, mag_b = a & 0x7F, b & 0x7F
    neighbours = (((a >> 7) == (b >> 7)) & ((mag_a - mag_b).abs() == 1)) | (torch.minimum(mag_a, mag_b) == 0) & (
        torch.maximum(mag_a, mag_b) == 1
    )
    midpoint = (ours.float() + theirs.float()) / 2 * _valid(r_s, counts).repeat_interleave(128, -1)
    near = (h32 - midpoint).abs() <= FP32_REORDER_REL * h32.abs().amax(-1, keepdim=True)
    print(f"\nprequantized h: {int(flipped.sum())} of {flipped.numel()} codes flipped, all traced")
    assert bool((neighbours & near)[flipped].all()), "an e4m3 code differs away from a rounding boundary"
    r_y = reference.moe_grouped_gemm((h_q, h_s), w2, s2, counts, out_dtype=torch.float32)  # the kernel's own h
    assert _rel(_valid(y, counts), _valid(r_y, counts)) < FP32_REORDER_REL  # measured 7.8e-8
    # moe_experts writes bf16, which the interpreter truncates: measured 4.0e-3.
    assert _rel(out, reference.moe_experts(x, meta, w13, s13, w2, s2, 0.5)) < BF16_TRUNC_REL


def test_reference_experts_match_the_model_moe_on_converted_mxfp4_weights():
    from model.deepseek_v41.moe import MoE
    from model.deepseek_v41.presets import TINY
    from model.deepseek_v41.quant import dequantize_mxfp4, quantize_mxfp4

    cfg = dataclasses.replace(TINY, hidden_size=256, moe_intermediate_size=128, swiglu_limit=0.3)
    torch.manual_seed(3)
    moe = MoE(cfg)
    packed = {}
    with torch.no_grad():
        moe.gate_weight.normal_(0, 0.1)
        moe.gate_bias.normal_(0, 0.1)
        for name in ("w1", "w2", "w3"):
            param = getattr(moe, name)
            stored = [quantize_mxfp4(m) for m in torch.randn_like(param) * 0.06]
            param.copy_(torch.stack([dequantize_mxfp4(p, s) for p, s in stored]))
            converted = [convert_mxfp4_expert(p, s) for p, s in stored]
            assert sum(c[2] for c in converted) == 0  # the conversion was exact
            packed[name] = (torch.stack([c[0] for c in converted]), torch.stack([c[1] for c in converted]))
    moe = moe.to(torch.bfloat16)  # as the model runs; MXFP4 values are exact in bf16
    x = torch.randn(7, cfg.hidden_size).to(torch.bfloat16)
    weights, experts = moe.route(x)
    r_weights, r_experts = reference.moe_router(
        x, moe.gate_weight, moe.gate_bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor
    )
    assert torch.equal(r_experts.long(), experts) and torch.allclose(r_weights, weights)
    meta = reference.route_metadata(experts, weights, cfg.n_routed_experts)
    w13 = stack_gate_up(packed["w1"][0], packed["w3"][0])
    s13 = stack_gate_up(packed["w1"][1], packed["w3"][1])
    ours = reference.moe_experts(x, meta, w13, s13, *packed["w2"], cfg.swiglu_limit)
    model = moe(x.unsqueeze(0))[0].float()  # shared expert weights are zero: routed experts only
    # FP8 activations (1×128 groups, quantised twice: x and h) are the only approximation: 7% here,
    # against 0.3% with them left unquantised; wrong routing, weights or SwiGLU give O(1).
    assert _rel(ours, model) < 0.1


S1 = dict(num_experts=48, hidden=5120, inter=2304, top_k=6)


@pytest.mark.parametrize("num_tokens", [1, 64, 256])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_experts_match_reference_at_s1_shapes(num_tokens):
    from kernels.moe_grouped_gemm import moe_experts, moe_grouped_gemm

    gen = torch.Generator("cuda").manual_seed(num_tokens)
    e, d, i = S1["num_experts"], S1["hidden"], S1["inter"]
    meta = _routing(num_tokens, e, S1["top_k"], gen)
    w13, s13 = _weights(e, 2 * i, d, gen)
    w2, s2 = _weights(e, d, i, gen)
    x = (torch.randn(num_tokens, d, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    h = moe_grouped_gemm(x, w13, s13, meta, gather=True, swiglu_limit=10.0, out_dtype=torch.float32)
    h_ref = reference.moe_grouped_gemm(
        x,
        w13,
        s13,
        meta["counts"],
        row_ids=meta["row_ids"],
        route_w=meta["route_w"],
        swiglu_limit=10.0,
        out_dtype=torch.float32,
    )
    # Hopper's FP8 MMA adds up each 128-deep step with fewer than fp32's mantissa bits (DeepSeek-V3
    # §3.3.2); the kernel promotes to fp32 every step. Measured 1.9e-4 on an H200 at T=256.
    assert _rel(_valid(h, meta["counts"]), _valid(h_ref, meta["counts"])) < 1e-3
    for prequantize in (True, False):
        out = moe_experts(x, meta, w13, s13, w2, s2, 10.0, prequantize=prequantize)
        ref = reference.moe_experts(x, meta, w13, s13, w2, s2, 10.0, prequantize=prequantize)
        assert torch.isfinite(out).all() and _rel(out, ref) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_moe_experts_replay_in_a_cuda_graph_with_new_routing():
    from kernels.moe_grouped_gemm import moe_experts

    gen = torch.Generator("cuda").manual_seed(11)
    e, d, i, num_tokens = S1["num_experts"], S1["hidden"], S1["inter"], 32
    w13, s13 = _weights(e, 2 * i, d, gen)
    w2, s2 = _weights(e, d, i, gen)
    x = torch.randn(num_tokens, d, generator=gen, device="cuda").to(torch.bfloat16)
    meta = _routing(num_tokens, e, S1["top_k"], gen)
    moe_experts(x, meta, w13, s13, w2, s2, 10.0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(x, meta, w13, s13, w2, s2, 10.0)
    for _ in range(2):  # new routing and tokens, same buffers: no host sync, no re-capture
        fresh = _routing(num_tokens, e, S1["top_k"], gen)
        for key, value in fresh.items():
            meta[key].copy_(value)
        x.copy_(torch.randn(num_tokens, d, generator=gen, device="cuda"))
        graph.replay()
        assert _rel(out, reference.moe_experts(x, meta, w13, s13, w2, s2, 10.0)) < 5e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_quantize_act_matches_reference_exactly():
    from kernels.quant_fp8 import quantize_act

    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(256, 5120, generator=gen, device="cuda") * torch.rand(256, 1, generator=gen, device="cuda") * 50
    x = x.to(torch.bfloat16)
    q, scale = quantize_act(x)
    r_q, r_scale = reference.quantize_act(x)
    assert torch.equal(scale, r_scale)
    assert torch.equal(q.view(torch.uint8), r_q.view(torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("num_tokens", "n", "k"), [(4096, 1280, 5120), (1024, 512, 5120)])
def test_gpu_prefill_linear_splits_m_with_the_same_bits(num_tokens, n, k):
    """A one-expert FP8 linear at prefill size (v41's wq_a, wkv) takes the M split by default; it gives
    the same bits as one program per N tile, and the dequantised product's values. The time of both is
    printed (not asserted)."""
    import time

    from kernels.moe_grouped_gemm import default_m_split, moe_grouped_gemm
    from kernels.quant_fp8 import quantize_act
    from services.worker.kernel_model.fp8_linear import one_expert_meta

    gen = torch.Generator("cuda").manual_seed(n)
    w, s = _weights(1, n, k, gen)
    x = quantize_act((torch.randn(num_tokens, k, generator=gen, device="cuda")).to(torch.bfloat16))
    meta = one_expert_meta(num_tokens, 1, torch.device("cuda"))
    assert (
        default_m_split(n // 128, num_tokens // 16, 2 * torch.cuda.get_device_properties(0).multi_processor_count) > 1
    )
    outs, times = {}, {}
    for m_split in (1, None):
        run = lambda: moe_grouped_gemm(x, w, s, meta, gather=True, block_m=16, m_split=m_split)  # noqa: E731
        outs[m_split] = run()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            run()
        torch.cuda.synchronize()
        times[m_split] = (time.perf_counter() - t0) / 5 * 1e6
    print(f"\nT={num_tokens} N={n} K={k}: one program per N tile {times[1]:.0f} µs, M split {times[None]:.0f} µs")
    assert torch.equal(outs[1], outs[None])
    dense = reference.dequantize_act(*x) @ reference.dequantize_weight_block128(w[0], s[0]).t()  # [T, n] fp32
    assert _rel(outs[None][0].float(), dense) < BF16_TRUNC_REL  # bf16 output (rounded to nearest on the GPU)


def _shared_routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    """``KernelMoE``'s layout: each token's top-k of the routed experts, then the shared one (id num_experts,
    weight 1), over num_experts + 1 stacked experts."""
    experts = torch.rand(num_tokens, num_experts, generator=gen, device=gen.device).argsort(-1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=gen, device=gen.device)
    shared = torch.full((num_tokens, 1), num_experts, dtype=experts.dtype, device=gen.device)
    return reference.route_metadata(
        torch.cat((experts, shared), 1), torch.cat((weights, torch.ones_like(weights[:, :1])), 1), num_experts + 1
    )


@pytest.mark.parametrize("prequantize", [True, False])
def test_shared_expert_in_its_own_launches_gives_the_one_launch_bits_interpreted(prequantize, monkeypatch):
    """40 tokens over 8 routed experts (top-1) and the shared one: BLOCK_M 16 (about 9 rows per expert), so the
    shared expert spans 3 M tiles and ``moe_experts`` launches it apart, split over M (3 items per N tile);
    the output equals the one launch's bit for bit."""
    gen = torch.Generator().manual_seed(12)
    num_experts, hidden, inter, num_tokens = 8, 128, 128, 40
    meta = _shared_routing(num_tokens, num_experts, 1, gen)
    w13, s13 = _weights(num_experts + 1, 2 * inter, hidden, gen)
    w2, s2 = _weights(num_experts + 1, hidden, inter, gen)
    x = (torch.randn(num_tokens, hidden, generator=gen) * 2).to(torch.bfloat16)
    mg = load_interpreted("moe_grouped_gemm")
    assert mg.default_block_m(meta["slot_of"].numel() / (num_experts + 1)) == 16 and mg.shared_apart(num_tokens, 16)
    launches = []
    real = mg.moe_grouped_gemm
    monkeypatch.setattr(
        mg,
        "moe_grouped_gemm",
        lambda *a, **kw: launches.append(kw["w"].shape[0] if "w" in kw else a[1].shape[0]) or real(*a, **kw),
    )
    with interpreter():
        apart = mg.moe_experts(x, meta, w13, s13, w2, s2, 0.5, prequantize=prequantize, shared_last=True)
        assert launches == [num_experts, num_experts, 1, 1]  # routed gate/up and down, then the shared ones
        one = mg.moe_experts(
            x, meta, w13, s13, w2, s2, 0.5, prequantize=prequantize, shared_last=True, shared_launch=False
        )
    assert launches[4:] == [num_experts + 1, num_experts + 1]
    assert torch.equal(apart, one)
    if prequantize:  # and both are the layer: test_prequantized_path_interpreted_matches_reference's bound
        ref = reference.moe_experts(x, meta, w13, s13, w2, s2, 0.5, shared_last=True)
        assert _rel(apart, ref) < BF16_TRUNC_REL


def test_shared_launch_with_no_live_row_does_nothing_interpreted():
    """No token routed (graph warm-up: every row dead, so no expert has rows and ``num_active`` is 0): the
    routed launch's −1 active experts and the shared launch's empty expert write nothing."""
    gen = torch.Generator().manual_seed(13)
    num_experts, hidden, inter, num_tokens = 8, 128, 128, 40
    meta = _shared_routing(num_tokens, num_experts, 1, gen)
    meta = dict(meta, counts=torch.zeros_like(meta["counts"]), num_active=torch.zeros_like(meta["num_active"]))
    w13, s13 = _weights(num_experts + 1, 2 * inter, hidden, gen)
    w2, s2 = _weights(num_experts + 1, hidden, inter, gen)
    mg = load_interpreted("moe_grouped_gemm")
    routed, shared = mg.split_shared(meta)
    assert int(routed["num_active"]) == -1 and shared["active"].tolist() == [0] and shared["num_active"].tolist() == [1]
    with interpreter():
        h = mg.empty_output(num_experts + 1, num_tokens, inter, torch.float32, torch.device("cpu"))
        h.fill_(7.0)
        x = torch.randn(num_tokens, hidden, generator=gen)
        mg.moe_grouped_gemm(
            x,
            w13[:-1],
            s13[:-1],
            routed,
            gather=True,
            swiglu_limit=0.5,
            out_dtype=torch.float32,
            block_m=16,
            out=h[:-1],
        )
        mg.moe_grouped_gemm(
            x,
            w13[-1:],
            s13[-1:],
            shared,
            gather=True,
            swiglu_limit=0.5,
            out_dtype=torch.float32,
            block_m=16,
            out=h[-1:],
        )
    assert bool((h == 7.0).all())
    with pytest.raises(ValueError, match="out must be"):
        mg.moe_grouped_gemm(x, w13, s13, meta, gather=True, swiglu_limit=0.5, out_dtype=torch.float32, out=h[:-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_shared_expert_apart_replays_in_a_cuda_graph_with_the_one_launch_bits():
    """v41-s1's layer at decode batch 256 (BLOCK_M 64: the shared expert spans 4 M tiles, so it is launched
    apart): captured once, replayed with new routing and tokens, every replay equal to the one-launch layer
    computed eagerly on the same inputs."""
    from kernels.moe_grouped_gemm import default_block_m, moe_experts, shared_apart

    gen = torch.Generator("cuda").manual_seed(14)
    e, d, i, num_tokens = S1["num_experts"], S1["hidden"], S1["inter"], 256
    w13, s13 = _weights(e + 1, 2 * i, d, gen)
    w2, s2 = _weights(e + 1, d, i, gen)
    x = torch.randn(num_tokens, d, generator=gen, device="cuda").to(torch.bfloat16)
    meta = _shared_routing(num_tokens, e, S1["top_k"], gen)
    assert shared_apart(num_tokens, default_block_m(meta["slot_of"].numel() / (e + 1)))
    moe_experts(x, meta, w13, s13, w2, s2, 10.0, shared_last=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_experts(x, meta, w13, s13, w2, s2, 10.0, shared_last=True)
    for _ in range(2):
        fresh = _shared_routing(num_tokens, e, S1["top_k"], gen)
        for key, value in fresh.items():
            meta[key].copy_(value)
        x.copy_(torch.randn(num_tokens, d, generator=gen, device="cuda"))
        graph.replay()
        one = moe_experts(x, meta, w13, s13, w2, s2, 10.0, shared_last=True, shared_launch=False)
        assert torch.equal(out, one)


@pytest.mark.parametrize("num_tokens", [1, 16])
def test_decode_rows_quantised_in_the_gate_up_loop_give_the_prequantised_bits_interpreted(num_tokens, monkeypatch):
    """Up to ``quant_fp8.IN_GEMM_MAX_ROWS`` rows ``moe_experts`` hands x to the gate/up GEMM unquantised and
    the GEMM quantises it in its K loop (no ``quantize_act`` launch): the same e4m3 codes and scales, so the
    layer's output bits equal those of x quantised first (the threshold patched below every row count)."""
    gen = torch.Generator().manual_seed(num_tokens + 20)
    num_experts, hidden, inter = 6, 256, 128
    meta = _shared_routing(num_tokens, num_experts, 2, gen)
    w13, s13 = _weights(num_experts + 1, 2 * inter, hidden, gen)
    w2, s2 = _weights(num_experts + 1, hidden, inter, gen)
    x = _tie_activations(num_tokens, hidden, gen)
    x[:, 128:] *= 2.0**-20  # the second block its own scale
    mg = load_interpreted("moe_grouped_gemm")
    launches = []
    real = mg.quantize_act
    monkeypatch.setattr(mg, "quantize_act", lambda a: launches.append(a.shape) or real(a))
    with interpreter():
        fused = mg.moe_experts(x, meta, w13, s13, w2, s2, 0.5, shared_last=True)
        assert launches == []
        monkeypatch.setattr(mg, "IN_GEMM_MAX_ROWS", 0)
        first = mg.moe_experts(x, meta, w13, s13, w2, s2, 0.5, shared_last=True)
        assert launches == [x.shape]
    assert torch.equal(fused.view(torch.int32), first.view(torch.int32))


def test_one_expert_gemm_quantises_in_its_loop_with_quantize_acts_bits_interpreted():
    """A decode linear's one-expert GEMM (``KernelLinear`` above the split-K sizes, ``GroupedKernelLinear``)
    given bf16 rows: the output bits of the rows quantised by ``quantize_act`` first, plain and gathered."""
    from services.worker.kernel_model.fp8_linear import group_rows_meta, one_expert_meta

    gen = torch.Generator().manual_seed(31)
    x = _tie_activations(12, 384, gen)
    x[:, 256:] *= 2.0**24
    w, s = _weights(1, 256, 384, gen)
    wg, sg = _weights(3, 128, 128, gen)
    mg, quant = load_interpreted("moe_grouped_gemm"), load_interpreted("quant_fp8")
    with interpreter():
        for a, w_, s_, meta in (
            (x, w, s, one_expert_meta(12, 1, x.device)),
            (x.view(36, 128), wg, sg, group_rows_meta(12, 3, x.device)),
        ):
            got = mg.moe_grouped_gemm(a, w_, s_, meta, gather=True, block_m=16)
            want = mg.moe_grouped_gemm(quant.quantize_act(a), w_, s_, meta, gather=True, block_m=16)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("num_tokens", [3, 40])
def test_output_rows_at_a_transposed_views_strides_hold_the_dense_outputs_bits_interpreted(num_tokens):
    """``GroupedKernelLinear``'s output: the GEMM writes group g's row t into a [T, G, R] buffer through its
    [G, T, R] view, bit for bit the dense [G, T, R] output transposed (one M tile, and three with m_split);
    the buffer's other bytes (R past N) untouched."""
    from services.worker.kernel_model.fp8_linear import group_rows_meta

    gen = torch.Generator().manual_seed(num_tokens)
    groups = 3
    x = _tie_activations(num_tokens * groups, 128, gen)
    w, s = _weights(groups, 256, 128, gen)
    meta = group_rows_meta(num_tokens, groups, x.device)
    mg = load_interpreted("moe_grouped_gemm")
    with interpreter():
        for m_split in (1, 3):
            dense = mg.moe_grouped_gemm(x, w, s, meta, gather=True, block_m=16, m_split=m_split)  # [G, T, N]
            buf = torch.full((num_tokens, groups, 384), 7.0, dtype=torch.bfloat16)
            got = mg.moe_grouped_gemm(
                x, w, s, meta, gather=True, block_m=16, m_split=m_split, out=buf[:, :, :256].transpose(0, 1)
            )
            assert got.data_ptr() == buf.data_ptr()
            assert torch.equal(buf[:, :, :256].view(torch.int16), dense.transpose(0, 1).view(torch.int16))
            assert bool((buf[:, :, 256:] == 7.0).all())
    with pytest.raises(ValueError, match="dense channels"):
        mg.moe_grouped_gemm(x, w, s, meta, gather=True, out=buf[:, :, :256].transpose(0, 2).transpose(1, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_gpu_decode_rows_quantised_in_the_gemm_loop_give_the_prequantised_bits(num_tokens, monkeypatch):
    """At the v41-s1 MoE and wq_b shapes: x quantised inside the GEMMs against ``quantize_act`` first, `==`."""
    import kernels.moe_grouped_gemm as mg
    from kernels.quant_fp8 import quantize_act
    from services.worker.kernel_model.fp8_linear import one_expert_meta

    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    num_experts, hidden, inter = 48, 5120, 2304  # v41-s1: 48 routed + the shared one
    meta = _shared_routing(num_tokens, num_experts, 6, gen)
    w13, s13 = _weights(num_experts + 1, 2 * inter, hidden, gen)
    w2, s2 = _weights(num_experts + 1, hidden, inter, gen)
    x = (torch.randn(num_tokens, hidden, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    fused = mg.moe_experts(x, meta, w13, s13, w2, s2, 10.0, shared_last=True)
    monkeypatch.setattr(mg, "IN_GEMM_MAX_ROWS", 0)
    first = mg.moe_experts(x, meta, w13, s13, w2, s2, 10.0, shared_last=True)
    assert torch.equal(fused.view(torch.int32), first.view(torch.int32))
    wq, sq = _weights(1, 32768, 1280, gen)  # wq_b: 256 N tiles, the one-expert GEMM (not split-K)
    xq = (torch.randn(num_tokens, 1280, generator=gen, device="cuda")).to(torch.bfloat16)
    meta1 = one_expert_meta(num_tokens, 1, x.device)
    got = mg.moe_grouped_gemm(xq, wq, sq, meta1, gather=True, block_m=16, num_warps=4)
    want = mg.moe_grouped_gemm(quantize_act(xq), wq, sq, meta1, gather=True, block_m=16, num_warps=4)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
