"""kernels/fp8_splitk.py: the split-K FP8 linear against the dequantised product, the one-pass grouped
GEMM, and itself at other batch sizes (a row's result must not depend on the batch)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.fp8_weights import quantize_weight_block128
from kernels.interpret import interpreter, load_interpreted
from services.worker.kernel_model.fp8_linear import one_expert_meta
from tests.tolerances import FP32_REORDER_REL


def _problem(num_tokens: int, n: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w, w_scale = quantize_weight_block128(torch.randn(n, k, generator=gen) * 0.05)
    x = torch.randn(num_tokens, k, generator=gen)
    return x, w, w_scale


@pytest.mark.parametrize(("num_tokens", "n", "k"), [(1, 256, 640), (5, 128, 512), (16, 256, 384), (3, 128 * 140, 1024)])
def test_splitk_equals_the_dequantised_product_and_the_grouped_gemm(num_tokens, n, k):
    sk, gg, quant = (load_interpreted(m) for m in ("fp8_splitk", "moe_grouped_gemm", "quant_fp8"))
    x, w, w_scale = _problem(num_tokens, n, k, seed=num_tokens)
    with interpreter():
        a = quant.quantize_act(x)
        got = sk.fp8_linear_splitk(a, w, w_scale, out_dtype=torch.float32)
        one_pass = gg.moe_grouped_gemm(
            a,
            w[None],
            w_scale[None],
            one_expert_meta(num_tokens, 1, x.device),
            gather=True,
            out_dtype=torch.float32,
            block_m=16,
        )[0]
    splits, per = sk.num_splits(n, k, x.device)  # as on a 132-SM GPU
    assert splits > 1 and splits * per == k // 128
    if n == 128 * 140:
        assert (splits, per) == (2, 4)  # 8 K blocks, at most 4 splits for 140 N tiles, never 2 per split
    exact = reference.dequantize_act(*a).double() @ reference.dequantize_weight_block128(w, w_scale).double().t()
    assert got.shape == (num_tokens, n) and got.dtype == torch.float32
    scale = float(exact.abs().max())
    assert float((got.double() - exact).abs().max()) <= FP32_REORDER_REL * scale
    assert float((got - one_pass).abs().max()) <= FP32_REORDER_REL * scale  # the same products, summed in another order


def test_a_rows_result_does_not_depend_on_the_batch():
    sk, quant = load_interpreted("fp8_splitk"), load_interpreted("quant_fp8")
    x, w, w_scale = _problem(9, 256, 512, seed=3)
    with interpreter():
        a = quant.quantize_act(x)
        batch = sk.fp8_linear_splitk(a, w, w_scale)
        alone = torch.cat([sk.fp8_linear_splitk((a[0][i : i + 1], a[1][i : i + 1]), w, w_scale) for i in range(9)])
    assert batch.dtype == torch.bfloat16 and torch.equal(batch, alone)


@pytest.mark.parametrize(("num_tokens", "n", "k"), [(1, 256, 640), (5, 128, 512), (16, 384, 1024)])
def test_the_last_program_sums_in_split_order_with_the_second_launchs_bits(num_tokens, n, k):
    """One launch (each N tile's last program adds the partials) against the partials added by a second
    launch: the same order, so the same bits, in fp32 and bf16; the ticket counters are 0 again after."""
    sk, quant = load_interpreted("fp8_splitk"), load_interpreted("quant_fp8")
    x, w, w_scale = _problem(num_tokens, n, k, seed=k)
    with interpreter():
        a = quant.quantize_act(x)
        for dtype in (torch.float32, torch.bfloat16):
            one = sk.fp8_linear_splitk(a, w, w_scale, out_dtype=dtype)
            two = sk.fp8_linear_splitk(a, w, w_scale, out_dtype=dtype, one_launch=False)
            assert torch.equal(one.view(torch.uint8), two.view(torch.uint8))
    assert sk.num_splits(n, k, x.device)[0] > 1
    assert all(int(t.abs().sum()) == 0 for t in sk._TICKETS.values())


def _ranged(x: torch.Tensor, seed: int) -> torch.Tensor:
    """x with each 128-channel block scaled by its own power of two in [2^-30, 2^30] (every block its own
    activation scale), block 1 of row 0 all zeros (the scale floor) and a few e4m3 ties (4-bit mantissas)."""
    gen = torch.Generator().manual_seed(seed)
    blocks = x.view(x.shape[0], -1, 128)
    blocks = blocks * torch.exp2(torch.randint(-30, 31, (*blocks.shape[:2], 1), generator=gen).float())
    blocks[0, min(1, blocks.shape[1] - 1)] = 0.0
    blocks[-1, 0, :8] = torch.tensor([1.0625, 1.1875, -3.375, 448.0, 449.0, 2.0**-9 * 1.5, -(2.0**-10), 17.0])
    return blocks.view(x.shape)


@pytest.mark.parametrize(("num_tokens", "n", "k"), [(1, 256, 640), (7, 128, 512), (16, 256, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantising_in_the_loop_gives_quantize_acts_bits(num_tokens, n, k, dtype):
    """bf16/fp32 rows quantised inside the kernel (no ``quantize_act`` launch) against the rows quantised by
    ``quantize_act`` first: the same e4m3 codes and scales, so the same output bits, in one launch or two."""
    sk, quant = load_interpreted("fp8_splitk"), load_interpreted("quant_fp8")
    x, w, w_scale = _problem(num_tokens, n, k, seed=k + num_tokens)
    x = _ranged(x, seed=n).to(dtype)
    with interpreter():
        for one_launch in (True, False):
            for out_dtype in (torch.float32, torch.bfloat16):
                want = sk.fp8_linear_splitk(
                    quant.quantize_act(x), w, w_scale, out_dtype=out_dtype, one_launch=one_launch
                )
                got = sk.fp8_linear_splitk(x, w, w_scale, out_dtype=out_dtype, one_launch=one_launch)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        strided = torch.cat((x, x), 1)[:, k:]  # rows at stride 2K: copied dense first
        assert torch.equal(
            sk.fp8_linear_splitk(strided, w, w_scale, out_dtype=torch.float32),
            sk.fp8_linear_splitk(quant.quantize_act(x), w, w_scale, out_dtype=torch.float32),
        )


def test_refuses_what_it_does_not_do():
    sk, quant = load_interpreted("fp8_splitk"), load_interpreted("quant_fp8")
    x, w, w_scale = _problem(17, 128, 256, seed=0)
    with interpreter():
        a = quant.quantize_act(x)
    with pytest.raises(ValueError, match="at most 16"):
        sk.fp8_linear_splitk(a, w, w_scale)
    with pytest.raises(ValueError, match="do not fit"):
        sk.fp8_linear_splitk((a[0][:2], a[1][:2]), w[:, :128], w_scale)
    with pytest.raises(ValueError, match="pre-quantised activations"):
        sk.fp8_linear_splitk((a[0][:2], a[1][:2, :1]), w, w_scale)
    with pytest.raises(ValueError, match="bf16/fp32"):
        sk.fp8_linear_splitk(a[0][:2], w, w_scale)  # e4m3 values without their scales


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n", "k"), [(1280, 5120), (512, 5120), (5120, 8192)])  # v41 wq_a, wkv, wo_b
def test_gpu_splitk_at_v41_projection_shapes(n, k):
    from kernels.fp8_splitk import fp8_linear_splitk
    from kernels.moe_grouped_gemm import moe_grouped_gemm
    from kernels.quant_fp8 import quantize_act

    x, w, w_scale = _problem(16, n, k, seed=n)
    x, w, w_scale = x.cuda(), w.cuda(), w_scale.cuda()
    a = quantize_act(x)
    got = fp8_linear_splitk(a, w, w_scale, out_dtype=torch.float32)
    one_pass = moe_grouped_gemm(
        a, w[None], w_scale[None], one_expert_meta(16, 1, x.device), gather=True, out_dtype=torch.float32, block_m=16
    )[0]
    assert float((got - one_pass).abs().max()) <= FP32_REORDER_REL * float(one_pass.abs().max())
    alone = torch.cat([fp8_linear_splitk((a[0][i : i + 1], a[1][i : i + 1]), w, w_scale) for i in range(16)])
    assert torch.equal(fp8_linear_splitk(a, w, w_scale), alone)
    # One launch (the last program of an N tile sums) against two: the same bits, every run.
    two = fp8_linear_splitk(a, w, w_scale, out_dtype=torch.float32, one_launch=False)
    for _ in range(20):
        assert torch.equal(fp8_linear_splitk(a, w, w_scale, out_dtype=torch.float32), two)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("n", "k"), [(1280, 5120), (512, 5120), (5120, 8192)])  # v41 wq_a, wkv, wo_b
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_gpu_quantising_in_the_loop_gives_quantize_acts_bits(n, k, num_tokens):
    from kernels.fp8_splitk import fp8_linear_splitk
    from kernels.quant_fp8 import quantize_act

    x, w, w_scale = _problem(num_tokens, n, k, seed=k)
    x, w, w_scale = _ranged(x, seed=n).to(torch.bfloat16).cuda(), w.cuda(), w_scale.cuda()
    for out_dtype in (torch.float32, torch.bfloat16):
        want = fp8_linear_splitk(quantize_act(x), w, w_scale, out_dtype=out_dtype)
        got = fp8_linear_splitk(x, w, w_scale, out_dtype=out_dtype)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
