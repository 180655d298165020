"""kernels/moe_splitk.py: the split-K grouped FP8 GEMM against the one-pass grouped GEMM (the same products, K
block sums grouped per split) and ``kernels.reference``, interpreted on CPU at small shapes with several K
blocks and splits and experts holding 0, 1 and several tokens; compiled on a GPU at v41-s1's expert shapes.

Tolerances against the one pass (tests/tolerances.py): both kernels form the same per-128-block products
p_kb (the same ``tl.dot`` on the same tiles, the same scales) and differ only in how the K/128 fp32 block
sums are grouped: ((p_0 + p_1) + …) against Σ_s (Σ_{kb in s} p_kb). Two orders of an fp32 sum differ by at
most the rounding of the partial sums, ≤ (K/128)·u32·Σ|p_kb| in the worst case and ≈ √(K/128)·u32·S as a
random walk: FP32_REORDER_REL (derived there for reductions of up to 8,192 terms) bounds it with room at
K/128 ≤ 64. Through the clamped SwiGLU, h = silu(min(g, L))·clamp(u)·w moves by at most
w·(max|silu'|·|u|·|Δg| + |silu(g)|·|Δu|) ≤ w·(1.1 + 1)·S·ε·S, with S = max(|g|, |u|) and ε·S the
pre-activation bound (|silu(g)| ≤ |g|, |silu'| ≤ 1.1): ``_swiglu_bound``. A bf16 or e4m3 output rounds two
values that close to the same code or to neighbours: one code step at most.
"""

from __future__ import annotations

import pytest
import torch

from kernels import invariance, reference
from kernels.fp8_weights import quantize_weight_block128
from kernels.interpret import interpreter, load_interpreted
from tests.tolerances import FP8_LINEAR_REL, FP32_REORDER_REL

LIMIT = 1.0  # the tiny preset's SwiGLU clamp: some pre-activations clamp at these scales
E, T, D, I = 5, 6, 512, 256  # gate/up: N_out 256 (2 tiles), K 512 (4 blocks); down: N 512, K 256 (2 blocks)
# Top-2 of 5: expert 0 holds 6 tokens, 1 holds 4, 2 and 3 one each, 4 none.
PICKS = [[0, 1], [0, 2], [0, 1], [3, 0], [0, 1], [1, 0]]


def _modules():
    return tuple(load_interpreted(m) for m in ("moe_splitk", "moe_grouped_gemm", "quant_fp8"))


def _problem(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    meta = reference.route_metadata(torch.tensor(PICKS), torch.rand(T, 2, generator=gen) + 0.5, E)
    w13, s13 = quantize_weight_block128(torch.randn(E, 2 * I, D, generator=gen) * 0.05)
    w2, s2 = quantize_weight_block128(torch.randn(E, D, I, generator=gen) * 0.05)
    x = torch.randn(T, D, generator=gen).to(torch.bfloat16)
    return meta, (w13, s13), (w2, s2), x


def _written(out: torch.Tensor, meta: dict) -> torch.Tensor:
    """The written slots of a masked [E, cap, N] output, stacked (the others are never written)."""
    return torch.cat([out[e, : int(meta["counts"][e])] for e in range(out.shape[0])])


def _swiglu_bound(a, w, s, meta) -> float:
    """|Δh| bound of the module docstring: 2.1 · max w_route · S · (FP32_REORDER_REL · S)."""
    pre = reference.moe_grouped_gemm(a, w, s, meta["counts"], row_ids=meta["row_ids"], out_dtype=torch.float32)
    assert isinstance(pre, torch.Tensor)
    big = float(_written(pre, meta).abs().max())
    return 2.1 * float(meta["route_w"].max()) * big * FP32_REORDER_REL * big


def _code_steps(q: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """How many e4m3 codes apart two e4m3 tensors (viewed as uint8) are: magnitudes order as their 7 low bits."""
    a, b = q.int(), want.int()
    same_sign = ((a ^ b) & 0x80) == 0
    return torch.where(same_sign, (a & 0x7F) - (b & 0x7F), (a & 0x7F) + (b & 0x7F)).abs()


def test_meta_layout_has_experts_with_zero_one_and_several_tokens():
    meta = _problem()[0]
    assert meta["counts"].tolist() == [6, 4, 1, 1, 0]
    sk = _modules()[0]
    assert sk.num_splits(I, D, 2, torch.device("cpu")) == (4, 1)  # as on a 132-SM GPU
    assert sk.num_splits(D, I, 2, torch.device("cpu")) == (2, 1)


@pytest.mark.parametrize("prequantize", [True, False])
@pytest.mark.parametrize("splits", [None, 2])
def test_gate_up_swiglu_matches_the_one_pass_and_the_reference(prequantize, splits):
    sk, gg, quant = _modules()
    meta, (w13, s13), _, x = _problem()
    with interpreter():
        a = quant.quantize_act(x) if prequantize else x
        kw = dict(gather=True, swiglu_limit=LIMIT)
        got = {
            dt: sk.moe_grouped_gemm_splitk(a, w13, s13, meta, out_dtype=dt, splits=splits, **kw)
            for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
        }
        one = {
            dt: gg.moe_grouped_gemm(a, w13, s13, meta, out_dtype=dt, **kw)
            for dt in (torch.float32, torch.bfloat16, torch.float8_e4m3fn)
        }
    ref = reference.moe_grouped_gemm(
        a,
        w13,
        s13,
        meta["counts"],
        row_ids=meta["row_ids"],
        route_w=meta["route_w"],
        swiglu_limit=LIMIT,
        out_dtype=torch.float32,
    )
    bound = _swiglu_bound(a, w13, s13, meta)
    f32 = _written(got[torch.float32], meta)
    assert float((f32 - _written(one[torch.float32], meta)).abs().max()) <= bound
    assert float((f32 - _written(ref, meta)).abs().max()) <= bound
    # bf16: the same value rounded, or a neighbour (one ulp: ≤ 2^-7 of the magnitude, or the fp32 bound).
    b16, b16_one = _written(got[torch.bfloat16], meta).float(), _written(one[torch.bfloat16], meta).float()
    assert torch.all((b16 - b16_one).abs() <= 2.0**-7 * b16_one.abs() + bound)
    # e4m3 + scales: the same group scales, each code the same or its neighbour.
    (q, s8), (q_one, s8_one) = got[torch.float8_e4m3fn], one[torch.float8_e4m3fn]
    assert torch.equal(_written(s8, meta), _written(s8_one, meta))
    assert int(_code_steps(_written(q.view(torch.uint8), meta), _written(q_one.view(torch.uint8), meta)).max()) <= 1


@pytest.mark.parametrize("prequantize", [True, False])
def test_down_matches_the_one_pass_and_the_reference(prequantize):
    sk, gg, quant = _modules()
    meta, _, (w2, s2), _ = _problem()
    h = torch.randn(E, T, I, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    with interpreter():
        a = quant.quantize_act(h.reshape(-1, I)) if prequantize else h
        if prequantize:
            a = (a[0].view(E, T, I), a[1].view(E, T, I // 128))
        got = sk.moe_grouped_gemm_splitk(a, w2, s2, meta, gather=False, out_dtype=torch.float32)
        one = gg.moe_grouped_gemm(a, w2, s2, meta, gather=False, out_dtype=torch.float32)
    ref = reference.moe_grouped_gemm(a, w2, s2, meta["counts"], out_dtype=torch.float32)
    scale = float(_written(ref, meta).abs().max())
    assert float((_written(got, meta) - _written(one, meta)).abs().max()) <= FP32_REORDER_REL * scale
    assert float((_written(got, meta) - _written(ref, meta)).abs().max()) <= FP32_REORDER_REL * scale


def test_the_sum_is_the_partials_in_split_order_and_a_dropped_split_fails():
    """The last item's sum is exactly ((0 + p_0) + p_1) + … of the partials it read (fp32 adds, the same in
    torch): a reversed order gives other bits here and a dropped split misses the one pass by far more than
    the reordering bound, so both checks below would fail on such a kernel."""
    sk, gg, quant = _modules()
    meta, (w13, s13), _, x = _problem(seed=3)
    splits = sk.num_splits(2 * I, D, 2, torch.device("cpu"))[0]
    assert splits == 4
    partials = torch.full((splits, E * T, 2 * I), float("nan"))
    with interpreter():
        a = quant.quantize_act(x)
        got = sk.moe_grouped_gemm_splitk(a, w13, s13, meta, gather=True, out_dtype=torch.float32, partials=partials)
        one = gg.moe_grouped_gemm(a, w13, s13, meta, gather=True, out_dtype=torch.float32)
    slots = torch.cat([torch.arange(int(c)) + e * T for e, c in enumerate(meta["counts"])])
    parts = partials[:, slots]  # [splits, written slots, N_w]
    in_order = torch.zeros_like(parts[0])
    for s in range(splits):
        in_order = in_order + parts[s]
    reversed_order = torch.zeros_like(parts[0])
    for s in reversed(range(splits)):
        reversed_order = reversed_order + parts[s]
    got, one = _written(got, meta), _written(one, meta)
    assert torch.equal(got, in_order)
    assert not torch.equal(reversed_order, in_order)  # the exact check above tells the orders apart
    bound = FP32_REORDER_REL * float(one.abs().max())
    assert float((got - one).abs().max()) <= bound
    for dropped in range(splits):
        assert float((in_order - parts[dropped] - one).abs().max()) > 100 * bound


def test_same_bits_on_two_runs_and_the_counters_back_at_zero():
    sk, _, quant = _modules()
    meta, (w13, s13), (w2, s2), x = _problem(seed=1)
    with interpreter():
        a = quant.quantize_act(x)
        runs = [
            sk.moe_grouped_gemm_splitk(
                a, w13, s13, meta, gather=True, swiglu_limit=LIMIT, out_dtype=torch.float8_e4m3fn
            )
            for _ in range(2)
        ]
        layers = [sk.moe_experts_splitk(x, meta, w13, s13, w2, s2, LIMIT) for _ in range(2)]
    (q0, s0), (q1, s1) = runs
    assert torch.equal(_written(q0.view(torch.uint8), meta), _written(q1.view(torch.uint8), meta))
    assert torch.equal(_written(s0, meta), _written(s1, meta))
    assert torch.equal(layers[0], layers[1])
    assert sk._TICKETS and all(int(t.abs().sum()) == 0 for t in sk._TICKETS.values())


@pytest.mark.parametrize("prequantize", [True, False])
def test_the_layer_matches_moe_experts_and_a_rows_result_does_not_depend_on_its_batch(prequantize):
    sk, gg, _ = _modules()
    meta, (w13, s13), (w2, s2), x = _problem(seed=2)
    args = (w13, s13, w2, s2, LIMIT)
    with interpreter():
        got = sk.moe_experts_splitk(x, meta, *args, prequantize=prequantize)
        one = gg.moe_experts(x, meta, *args, prequantize=prequantize)
        alone = torch.cat(
            [
                sk.moe_experts_splitk(
                    x[t : t + 1],
                    reference.route_metadata(
                        torch.tensor(PICKS[t : t + 1]), meta["route_w"].flatten()[meta["slot_of"][t]][None], E
                    ),
                    *args,
                    prequantize=prequantize,
                )
                for t in range(T)
            ]
        )
    ref = reference.moe_experts(x, meta, *args, prequantize=prequantize)
    assert got.shape == (T, D) and got.dtype == torch.float32
    assert torch.equal(got, alone)
    # h's codes may differ from the one pass's by a step where the reordering crosses a rounding boundary;
    # the layer's error against the reference is FP8's (tests/tolerances.py), and the one pass's the same.
    rel = float((got - ref).norm() / ref.norm())
    assert rel <= FP8_LINEAR_REL and float((one - ref).norm() / ref.norm()) <= FP8_LINEAR_REL
    assert float((got - one).norm() / one.norm()) <= FP8_LINEAR_REL


def test_worth_splitting_at_decode_only_outside_the_invariant_mode():
    sk = _modules()[0]
    w13, w2 = torch.empty(49, 2 * 2304, 5120, device="meta"), torch.empty(49, 5120, 2304, device="meta")

    def meta(num_tokens: int) -> dict:
        return {
            "row_ids": torch.empty(49, num_tokens, device="meta"),
            "slot_of": torch.empty(num_tokens, 7, device="meta"),
        }

    # v41-s1 on 132 SMs at 7 picks a row: gate/up 18 tiles × 7 = 126 slabs → 5 splits of 8 K blocks;
    # down 40 × 7 = 280 → 2 of 9.
    assert sk.num_splits(2304, 5120, 7, w13.device) == (5, 8)
    assert sk.num_splits(5120, 2304, 7, w13.device) == (2, 9)
    assert sk.worth_splitting_experts(meta(1), w13, w2) and sk.worth_splitting_experts(meta(16), w13, w2)
    assert not sk.worth_splitting_experts(meta(17), w13, w2)
    with invariance.fixed_configs():
        assert not sk.worth_splitting_experts(meta(1), w13, w2)
    # Enough slabs to fill the SMs in one split each: no split.
    assert not sk.worth_splitting_experts({"row_ids": meta(1)["row_ids"], "slot_of": torch.empty(1, 700)}, w13, w2)


def test_refuses_what_it_does_not_do():
    sk, _, quant = _modules()
    meta, (w13, s13), (w2, s2), x = _problem()
    with pytest.raises(ValueError, match="splits must divide"):
        sk.moe_grouped_gemm_splitk(x, w13, s13, meta, gather=True, swiglu_limit=LIMIT, splits=3)
    with pytest.raises(ValueError, match="SwiGLU"):
        sk.moe_grouped_gemm_splitk(x, w13, s13, meta, gather=True, out_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="partials"):
        sk.moe_grouped_gemm_splitk(x, w13, s13, meta, gather=True, swiglu_limit=LIMIT, partials=torch.empty(1))
    with pytest.raises(ValueError, match="activations"):
        sk.moe_grouped_gemm_splitk(x[:, :256], w13, s13, meta, gather=True, swiglu_limit=LIMIT)


S1 = dict(num_experts=48, hidden=5120, inter=2304, top_k=6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_gpu_splitk_at_s1_expert_shapes(num_tokens):
    """v41-s1's 48 routed experts + the shared one (stacked last, every row picks it): each GEMM against the
    one pass (the reordering bound) and the reference, the layer against the reference, the same bits on
    20 runs, for each row alone and in a graph replay, the counters back at 0."""
    from kernels.moe_grouped_gemm import moe_experts, moe_grouped_gemm
    from kernels.moe_splitk import _TICKETS, moe_experts_splitk, moe_grouped_gemm_splitk, worth_splitting_experts
    from kernels.quant_fp8 import quantize_act

    gen = torch.Generator("cuda").manual_seed(num_tokens)
    e, d, i, k = S1["num_experts"] + 1, S1["hidden"], S1["inter"], S1["top_k"]
    routed = torch.rand(num_tokens, e - 1, generator=gen, device="cuda").argsort(-1)[:, :k]
    picks = torch.cat((routed, torch.full((num_tokens, 1), e - 1, device="cuda", dtype=routed.dtype)), 1)
    weights = torch.cat(
        (torch.rand(num_tokens, k, generator=gen, device="cuda"), torch.ones(num_tokens, 1, device="cuda")), 1
    )
    meta = reference.route_metadata(picks, weights, e)
    w13, s13 = quantize_weight_block128(torch.randn(e, 2 * i, d, generator=gen, device="cuda") * 0.05)
    w2, s2 = quantize_weight_block128(torch.randn(e, d, i, generator=gen, device="cuda") * 0.05)
    x = (torch.randn(num_tokens, d, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    assert worth_splitting_experts(meta, w13, w2)
    a = quantize_act(x)
    kw = dict(gather=True, swiglu_limit=10.0, out_dtype=torch.float32)
    h, h_one = moe_grouped_gemm_splitk(a, w13, s13, meta, **kw), moe_grouped_gemm(a, w13, s13, meta, **kw)
    h_ref = reference.moe_grouped_gemm(
        a,
        w13,
        s13,
        meta["counts"],
        row_ids=meta["row_ids"],
        route_w=meta["route_w"],
        swiglu_limit=10.0,
        out_dtype=torch.float32,
    )
    diff = float((_written(h, meta) - _written(h_one, meta)).abs().max())
    print(f"T={num_tokens} gate/up vs one pass max |Δ| {diff:.3e}, bound {_swiglu_bound(a, w13, s13, meta):.3e}")
    assert diff <= _swiglu_bound(a, w13, s13, meta)
    # Hopper's FP8 MMA: the one pass's bound against the reference (tests/kernels/test_moe_grouped_gemm.py).
    rel = float((_written(h, meta) - _written(h_ref, meta)).norm() / _written(h_ref, meta).norm())
    assert rel < 1e-3
    hq = quantize_act(torch.randn(e * num_tokens, i, generator=gen, device="cuda").to(torch.bfloat16))
    hq = (hq[0].view(e, num_tokens, i), hq[1].view(e, num_tokens, -1))
    y = moe_grouped_gemm_splitk(hq, w2, s2, meta, gather=False, out_dtype=torch.float32)
    y_one = moe_grouped_gemm(hq, w2, s2, meta, gather=False, out_dtype=torch.float32)
    scale = float(_written(y_one, meta).abs().max())
    diff = float((_written(y, meta) - _written(y_one, meta)).abs().max())
    print(f"T={num_tokens} down vs one pass max |Δ| {diff:.3e}, bound {FP32_REORDER_REL * scale:.3e}")
    assert diff <= FP32_REORDER_REL * scale
    out = moe_experts_splitk(x, meta, w13, s13, w2, s2, 10.0, shared_last=True)
    ref = reference.moe_experts(x, meta, w13, s13, w2, s2, 10.0, shared_last=True)
    one = moe_experts(x, meta, w13, s13, w2, s2, 10.0, shared_last=True)
    rel, rel_one = float((out - ref).norm() / ref.norm()), float((one - ref).norm() / ref.norm())
    print(f"T={num_tokens} layer vs reference: split-K {rel:.3e}, one pass {rel_one:.3e}")
    assert torch.isfinite(out).all() and rel < 5e-3  # the one pass's layer bound (test_moe_grouped_gemm.py)
    for _ in range(20):
        assert torch.equal(moe_experts_splitk(x, meta, w13, s13, w2, s2, 10.0, shared_last=True), out)
    for t in range(num_tokens):  # a row alone gives its bits in the batch
        alone = reference.route_metadata(picks[t : t + 1], weights[t : t + 1], e)
        row = moe_experts_splitk(x[t : t + 1], alone, w13, s13, w2, s2, 10.0, shared_last=True)
        assert torch.equal(row, out[t : t + 1])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = moe_experts_splitk(x, meta, w13, s13, w2, s2, 10.0, shared_last=True)
    for _ in range(3):
        graph.replay()
        assert torch.equal(replayed, out)
    torch.cuda.synchronize()
    assert all(int(t.abs().sum()) == 0 for t in _TICKETS.values())
