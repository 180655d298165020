"""KernelHead (services/worker/kernel_model/head.py): the bf16-weight head with fp32 logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from services.worker.kernel_model.head import KernelHead, exact_in_bf16, head_logits


def _bf16_exact_weight(vocab: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, dim, generator=gen) * 0.05).to(torch.bfloat16).float()  # fp32 holding bf16 values


def test_on_cpu_it_is_the_models_fp32_product_bit_for_bit():
    w = _bf16_exact_weight(300, 64, 0)
    y = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    head = KernelHead(w)
    assert head.weight.dtype == torch.bfloat16
    assert torch.equal(head(y), F.linear(y, w))
    linear = nn.Linear(64, 300, bias=False)
    linear.weight.data.copy_(w)
    assert torch.equal(head_logits(head, y), head_logits(linear, y))


def test_a_weight_not_exact_in_bf16_is_refused():
    w = _bf16_exact_weight(8, 16, 0)
    w[3, 5] += 1e-6  # below bf16's step at that magnitude
    assert not exact_in_bf16(w)
    with pytest.raises(ValueError, match="not exact in bf16"):
        KernelHead(w)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_split_bf16_gemm_matches_the_fp32_head():
    """v41 widths (vocab 129,280, D 4096 here to keep it small): the [y_hi; y_lo] bf16 GEMM against the
    fp64 product, next to the fp32 GEMM the model runs; both bounded relative to Σ|y||w| per logit."""
    vocab, dim = 129_280, 4096
    w = _bf16_exact_weight(vocab, dim, 2).cuda()
    head = KernelHead(w)
    torch.backends.cuda.matmul.allow_tf32 = False
    for rows in (1, 7, 256):
        y = torch.randn(rows, dim, generator=torch.Generator().manual_seed(rows)).cuda()
        exact = y.double() @ w.double().t()
        bound = y.double().abs() @ w.double().abs().t()
        got, fp32 = head(y), F.linear(y, w)
        err, err32 = ((got - exact).abs() / bound).max().item(), ((fp32 - exact).abs() / bound).max().item()
        print(f"rows {rows}: split bf16 max rel {err:.2e}, fp32 GEMM {err32:.2e}")
        assert got.dtype == torch.float32 and got.shape == (rows, vocab)
        assert err <= 2.0**-15, err  # y carried to 16 bits: 2^-17 each, plus fp32 accumulation
        yb = y.to(torch.bfloat16)  # a bf16 y is exact: one GEMM, fp32 accumulation only
        errb = ((head(yb) - yb.double() @ w.double().t()).abs() / bound).max().item()
        assert errb <= 2.0**-18, errb
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for rows in (1, 256):
        y = torch.randn(rows, dim, device="cuda")
        for label, fn in (("bf16 split", lambda: head(y)), ("fp32", lambda: F.linear(y, w))):
            fn()
            start.record()
            for _ in range(10):
                fn()
            end.record()
            torch.cuda.synchronize()
            print(f"rows {rows}: {label} head {start.elapsed_time(end) / 10 * 1e3:.0f} µs")
