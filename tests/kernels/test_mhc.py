"""mHC kernels vs ``model.deepseek_v41.mhc`` (HyperConnection.forward, collapse, expand): interpreted on
CPU at small shapes (random weights, and the tiny preset's HyperConnection), compiled on a GPU at the
Flash shapes (n 4, D 5120)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41 import mhc as ref
from model.deepseek_v41.presets import TINY, V41_S1
from tests.tolerances import BF16_CAST_REL, FP32_REORDER_REL

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _site(cfg, gen: torch.Generator, device: str = "cpu") -> ref.HyperConnection:
    """A HyperConnection with random weights at the scale of trained ones (logits of order 1)."""
    hc = ref.HyperConnection(cfg).to(device)
    n, k = hc.fn.shape
    with torch.no_grad():
        hc.fn.copy_(torch.randn(n, k, generator=gen, device=device) * k**-0.5 * 2)
        hc.base.copy_(torch.randn(n, generator=gen, device=device))
        hc.scale.copy_(torch.rand(3, generator=gen, device=device) + 0.5)
    return hc


def _streams(num_tokens: int, cfg, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    return (torch.randn(num_tokens, cfg.hc_mult, cfg.hidden_size, generator=gen, device=device) * 3).to(dtype)


def _ref_mix(hc: ref.HyperConnection, h: torch.Tensor) -> ref.Mix:
    """The module's Mix of h [T, n, D] (it takes [B, S, n, D]), as [T, …]."""
    with torch.no_grad():
        return ref.Mix(*(t[0] for t in hc(h.unsqueeze(0))))


def _ref_collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    return ref.collapse(h[None], pre[None])[0]


def _ref_expand(y: torch.Tensor, h: torch.Tensor, mix: ref.Mix) -> torch.Tensor:
    return ref.expand(y[None], h[None], ref.Mix(*(t[None] for t in mix)))[0]


GPU_MIX_REL = 1e-4
"""On the GPU both sides reduce 4·5120 fp32 products, in different orders (tensor-core tf32-split
partial sums against cuBLAS fp32), and a GPU run measured 2.6e-5 apart on pre at T = 1 with
the forced single split: fp32 reordering noise over 20K terms (√N·2⁻²⁴·Σ|terms| ~ 1e-5), not a fault."""


def _check_mix(got, expect: ref.Mix, rel: float = FP32_REORDER_REL) -> None:
    for name in ("pre", "post", "comb"):
        a, b = getattr(got, name), getattr(expect, name).reshape(getattr(got, name).shape)
        assert torch.allclose(a, b, rtol=rel, atol=rel), (name, float((a - b).abs().max()))


def _bf16_close(out: torch.Tensor, expect: torch.Tensor) -> None:
    # fp32 maths in a different order, then one rounding: at most one bf16 step apart (2^-8 relative).
    assert torch.all((out.float() - expect.float()).abs() <= BF16_CAST_REL * expect.float().abs() + 1e-5)


CASES = [
    (1, 64, torch.float32),
    (5, 128, torch.bfloat16),
    (3, 256, torch.float32),
    (33, 64, torch.float32),
    (17, 64, torch.bfloat16),
    (2, 80, torch.float32),  # D 80: 5 D tiles, a partial last split below
    (1, 4112, torch.float32),
]  # 257 splits at T 1: the finish sums three blocks of 128, the last one partial


@pytest.mark.parametrize(("num_tokens", "dim", "dtype"), CASES)
def test_mix_collapse_expand_interpreted(num_tokens, dim, dtype):
    cfg = dataclasses.replace(TINY, hidden_size=dim)
    gen = torch.Generator().manual_seed(num_tokens * dim)
    hc_a, hc_f = _site(cfg, gen), _site(cfg, gen)
    h = _streams(num_tokens, cfg, dtype, gen)
    y = (torch.randn(num_tokens, dim, generator=gen) * 2).to(dtype)
    pre_prev = torch.rand(num_tokens, cfg.hc_mult, generator=gen)
    k = load_interpreted("mhc")
    w_a, w_f = k.MixWeights.of(hc_a), k.MixWeights.of(hc_f)
    mix_a = _ref_mix(hc_a, h)
    h_new = _ref_expand(y, h, mix_a)
    mix_f = _ref_mix(hc_f, h_new)
    with interpreter():
        got = k.mhc_mix(h, w_a, pre_prev)
        split = k.mhc_mix(h, w_a, split=1)  # one program per token tile: the epilogue in the mix kernel
        ragged = k.mhc_mix(h, w_a, split=2)  # partial products, the last split short when D tiles are odd
        x = k.collapse(h, pre_prev)
        e = k.expand(y, h, mix_a)
        fused = k.mhc_expand_mix(y, h, mix_a, w_f, mix_a.pre)
    _check_mix(got.mix, mix_a)
    _check_mix(split.mix, mix_a)
    _check_mix(ragged.mix, mix_a)
    assert got.h is not None and split.x is None
    x_ref = _ref_collapse(h, pre_prev)
    if dtype == torch.float32:
        torch.testing.assert_close(got.x, x_ref, rtol=FP32_REORDER_REL, atol=FP32_REORDER_REL)
        torch.testing.assert_close(x, x_ref, rtol=FP32_REORDER_REL, atol=FP32_REORDER_REL)
        torch.testing.assert_close(e, h_new, rtol=FP32_REORDER_REL, atol=FP32_REORDER_REL)
        torch.testing.assert_close(fused.h, h_new, rtol=FP32_REORDER_REL, atol=FP32_REORDER_REL)
    else:
        for out, expect in ((got.x, x_ref), (x, x_ref), (e, h_new), (fused.h, h_new)):
            assert out.dtype == dtype
            _bf16_close(out, expect)
    # The mix and collapse of the streams as stored (the interpreter rounds fp32 → bf16 by truncation,
    # so its bf16 h' sits one step from the reference's; h' itself is checked above).
    _check_mix(fused.mix, _ref_mix(hc_f, fused.h))
    if dtype == torch.float32:
        _check_mix(fused.mix, mix_f)
    x_f = _ref_collapse(fused.h, mix_a.pre)
    if dtype == torch.float32:
        torch.testing.assert_close(fused.x, x_f, rtol=FP32_REORDER_REL, atol=FP32_REORDER_REL)
    else:
        _bf16_close(fused.x, x_f)


def test_tiny_preset_layer_chain_interpreted():
    """Two layers' mHC as the model runs them (spec §3.1), from the first h (n stride-0 copies of the
    embedding, [B, S, n, D]) and the one-hot initial pre, through the fused kernels, vs the module."""
    gen = torch.Generator().manual_seed(7)
    sites = [_site(TINY, gen) for _ in range(4)]  # attn, ffn of layer 0; attn, ffn of layer 1
    e = torch.randn(2, 3, TINY.hidden_size, generator=gen)
    h = e.unsqueeze(2).expand(-1, -1, TINY.hc_mult, -1)  # [B, S, n, D], stride 0 over n
    pre = ref.initial_pre(e.shape[:2], TINY.hc_mult)
    outs = [torch.randn(2, 3, TINY.hidden_size, generator=gen) for _ in range(4)]  # sublayer outputs
    k = load_interpreted("mhc")
    weights = [k.MixWeights.of(s) for s in sites]
    with interpreter():
        step = k.mhc_mix(h, weights[0], pre)
        xs, mix, h_k = [step.x], step.mix, step.h
        for i in range(1, 4):  # a sublayer's output expands the streams; the next site mixes them and
            # collapses them with the previous site's pre (spec §3.1)
            step = k.mhc_expand_mix(outs[i - 1], h_k, mix, weights[i], mix.pre)
            mix, h_k = step.mix, step.h
            xs.append(step.x)
        h_last = k.expand(outs[3], h_k, mix)
        y = k.collapse(h_last, mix.pre)
    with torch.no_grad():
        h_r, pre_r, xs_r = h, pre, []
        for layer in range(2):
            mix_a = sites[2 * layer](h_r)
            xs_r.append(ref.collapse(h_r, pre_r))
            h_r = ref.expand(outs[2 * layer], h_r, mix_a)
            mix_f = sites[2 * layer + 1](h_r)
            xs_r.append(ref.collapse(h_r, mix_a.pre))
            h_r = ref.expand(outs[2 * layer + 1], h_r, mix_f)
            pre_r = mix_f.pre
        y_r = ref.collapse(h_r, pre_r)
    for x, x_r in zip(xs, xs_r):
        torch.testing.assert_close(x.view(x_r.shape), x_r, rtol=FP32_REORDER_REL, atol=FP32_REORDER_REL)
    torch.testing.assert_close(h_last.view(h_r.shape), h_r, rtol=FP32_REORDER_REL, atol=FP32_REORDER_REL)
    torch.testing.assert_close(y.view(y_r.shape), y_r, rtol=FP32_REORDER_REL, atol=FP32_REORDER_REL)


def test_bench_problem_builds_on_cpu():
    from services.bench.kernels import mhc as kernels_mhc

    p = kernels_mhc.problem(3, torch.Generator().manual_seed(0), device="cpu", hidden=64)
    assert p["h"].shape == (3, 4, 64) and p["mix"].comb.shape == (3, 4, 4)
    for fn in kernels_mhc.torch_ops(p).values():
        fn()


@pytest.fixture
def fp32_reference_matmuls():
    """The module's F.linear is the fp32 reference: no TF32 in cuBLAS, whatever ran before."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = before


def _gpu_problem(num_tokens: int):
    cfg = V41_S1
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    hc_a, hc_f = _site(cfg, gen, "cuda"), _site(cfg, gen, "cuda")
    h = _streams(num_tokens, cfg, torch.bfloat16, gen, "cuda")
    y = (torch.randn(num_tokens, cfg.hidden_size, generator=gen, device="cuda") * 2).to(torch.bfloat16)
    pre = torch.rand(num_tokens, cfg.hc_mult, generator=gen, device="cuda")
    return hc_a, hc_f, h, y, pre


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_mhc_gpu_matches_module(num_tokens, fp32_reference_matmuls):
    from kernels import mhc

    hc_a, hc_f, h, y, pre = _gpu_problem(num_tokens)
    w_a, w_f = mhc.MixWeights.of(hc_a), mhc.MixWeights.of(hc_f)
    mix_a = _ref_mix(hc_a, h)
    got = mhc.mhc_mix(h, w_a, pre)
    _check_mix(got.mix, mix_a, GPU_MIX_REL)
    _bf16_close(got.x, _ref_collapse(h, pre))
    h_new = _ref_expand(y, h, mix_a)
    _bf16_close(mhc.expand(y, h, mix_a), h_new)
    _bf16_close(mhc.collapse(h, pre), _ref_collapse(h, pre))
    fused = mhc.mhc_expand_mix(y, h, mix_a, w_f, mix_a.pre)
    _bf16_close(fused.h, h_new)
    _check_mix(fused.mix, _ref_mix(hc_f, fused.h), GPU_MIX_REL)
    # h' may differ from the module's by a bf16 step (one ulp, 2^-8 relative) in a few of T · 4 · hidden
    # elements: at T 4096 one such step moved a post weight by 7.0e-4 (H200).
    _check_mix(fused.mix, _ref_mix(hc_f, h_new), rel=2e-3)
    _bf16_close(fused.x, _ref_collapse(fused.h, mix_a.pre))
    for split in (1, 3):  # the fused epilogue and the partial-products path at every size
        # Another fp32 summation order than the default split's: post max |Δ| 2.7e-4 at T 4096 (H200)
        _check_mix(mhc.mhc_mix(h, w_a, split=split).mix, mix_a, 5 * GPU_MIX_REL)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _one_launch_equals_two(k, h, y, mix_in, w_a, w_f, pre, split):
    """mhc_mix and mhc_expand_mix with the split finished in the mix launch (one token) and by the finishing
    kernel: every output's bits equal. Another h first, so a partial buffer handed on holds stale values."""
    k.mhc_mix(-h, w_a, pre, split=split)
    pairs = [(k.mhc_mix(h, w_a, pre, split=split), k.mhc_mix(h, w_a, pre, split=split, one_launch=False))]
    k.mhc_expand_mix(-y, h, mix_in, w_f, pre, split=split)
    pairs.append(
        (
            k.mhc_expand_mix(y, h, mix_in, w_f, pre, split=split),
            k.mhc_expand_mix(y, h, mix_in, w_f, pre, split=split, one_launch=False),
        )
    )
    for one, two in pairs:
        assert all(_same_bits(a, b) for a, b in zip(one.mix, two.mix))
        assert _same_bits(one.h, two.h) and _same_bits(one.x, two.x)


@pytest.mark.parametrize(
    ("dim", "dtype", "split"), [(64, torch.float32, 2), (80, torch.bfloat16, None), (128, torch.float32, 3)]
)
def test_one_token_mix_finished_in_its_launch_gives_the_finishing_kernels_bits_interpreted(dim, dtype, split):
    """At one token the split mix's last program finishes (``FINISH_IN_MIX_MAX_TOKENS``): the same bits as
    the finishing kernel, and every ticket counter is 0 after. (Both sum through ``_finish``: the many-block
    sums of D 4112 are test_mix_collapse_expand_interpreted's, and take a minute here.)"""
    from kernels import tickets

    cfg = dataclasses.replace(TINY, hidden_size=dim)
    gen = torch.Generator().manual_seed(dim)
    hc_a, hc_f = _site(cfg, gen), _site(cfg, gen)
    h = _streams(1, cfg, dtype, gen)
    y = (torch.randn(1, dim, generator=gen) * 2).to(dtype)
    pre = torch.rand(1, cfg.hc_mult, generator=gen)
    k = load_interpreted("mhc")
    assert k.FINISH_IN_MIX_MAX_TOKENS >= 1
    w_a, w_f = k.MixWeights.of(hc_a), k.MixWeights.of(hc_f)
    with interpreter():
        mix_in = k.mhc_mix(h, w_a).mix
        _one_launch_equals_two(k, h, y, mix_in, w_a, w_f, pre, split)
    assert any(key[0] == "mhc_mix" for key in tickets._TICKETS) and tickets.all_zero()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mhc_gpu_one_token_finished_in_its_launch_gives_the_finishing_kernels_bits():
    from kernels import mhc, tickets

    hc_a, hc_f, h, y, pre = _gpu_problem(1)
    w_a, w_f = mhc.MixWeights.of(hc_a), mhc.MixWeights.of(hc_f)
    mix_in = mhc.mhc_mix(h, w_a).mix
    for _ in range(20):  # who finishes depends on timing; the bits must not
        _one_launch_equals_two(mhc, h, y, mix_in, w_a, w_f, pre, None)
    assert tickets.all_zero()
