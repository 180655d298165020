"""KernelMoE's live-row mask (services/worker/kernel_moe.py), the static decode step's placeholder rows:
rows outside the mask are routed nowhere (no slot, no expert, no count) and come out as zeros, and the
live rows' outputs and counts are those of a call on the live rows alone. Interpreted on CPU (fp8: the
grouped GEMM kernel; fp32: the torch twin of the masked layout); on a GPU the compiled kernels at a
V41 Flash-sized layer with half the rows dead."""

from __future__ import annotations

import copy

import pytest
import torch

from model.batch_invariant import batch_invariant
from services.worker.fp8_linear import KernelSet
from services.worker import kernel_moe
from services.worker.kernel_moe import KernelMoE
from tests.kernels.interpret import interpreter, load_interpreted
from tests.services.worker.test_model_runner import case


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _moe_kernels() -> KernelSet:
    names = ("rmsnorm", "quant_fp8", "moe_router", "moe_grouped_gemm", "decode_attention")
    return KernelSet(*(load_interpreted(name) for name in names), interpreted=True)


def check_live_mask(moe: KernelMoE, x: torch.Tensor, live: torch.Tensor, tol: float) -> None:
    """x [1, T, D], live bool [T]: masked call vs the live rows alone."""
    num_experts = moe.num_experts
    counts, alone_counts = (torch.zeros(num_experts, dtype=torch.long, device=x.device) for _ in range(2))
    out = moe(x, counts, live=live)
    alone = moe(x[:, live], alone_counts)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert torch.equal(out[:, ~live], torch.zeros_like(out[:, ~live]))
    assert torch.equal(counts, alone_counts) and int(counts.sum()) == int(live.sum()) * moe.top_k
    torch.testing.assert_close(out[:, live].float(), alone.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(moe(x, None, live=torch.ones_like(live)).float(), moe(x).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_dead_rows_route_nowhere_interpreted(precision):
    model = case("oracle").model
    kernels = _moe_kernels()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, model.cfg.hidden_size, generator=gen)
    live = torch.tensor([True, True, False, True, False, True, True, False])
    with interpreter(), batch_invariant():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), precision, kernels)
        # Row-wise maths: only the GEMMs' row counts differ (fp32: bmm over other capacities, which the
        # batch-invariant mode sums in one order; fp8: the kernel's rows are independent), so bits agree.
        check_live_mask(moe, x, live, tol=0.0)
        # No live row at all (graph warm-up): every expert idle, zeros out.
        counts = torch.zeros(moe.num_experts, dtype=torch.long)
        out = moe(x, counts, live=torch.zeros_like(live))
        assert int(counts.sum()) == 0 and torch.equal(out, torch.zeros_like(out))


def test_decode_sizes_take_the_layout_kernel_and_match_the_torch_layout(monkeypatch):
    """Up to LAYOUT_MAX_TOKENS the layout is kernels/moe_layout.py's one launch; the torch layout gives
    the same outputs and counts (a kernel set without ``moe_layout``, e.g. the references, takes it)."""
    model = case("oracle").model
    x = torch.randn(1, 9, model.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    live = torch.tensor([True, False, True, True, True, False, True, True, True])
    with interpreter():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), "fp8", _moe_kernels())
        results = []
        for kernel in (True, False):
            if kernel:
                monkeypatch.setattr(KernelMoE, "_layout", lambda *a: pytest.fail("took the torch layout"))
            else:
                monkeypatch.undo()
                monkeypatch.setattr(moe.kernels.moe_router, "LAYOUT_MAX_TOKENS", 0)
            counts = torch.zeros(moe.num_experts, dtype=torch.long)
            results.append((moe(x, counts, live=live), counts))
    (out_k, counts_k), (out_t, counts_t) = results
    assert torch.equal(out_k, out_t) and torch.equal(counts_k, counts_t) and int(counts_k.sum()) == 7 * moe.top_k


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_long_steps_run_in_passes_with_the_same_rows(precision, monkeypatch):
    """Above MOE_MAX_TOKENS the tokens go through in passes (prefill memory): the same outputs and
    counts as one pass, with and without a live mask."""
    model = case("oracle").model
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 8, model.cfg.hidden_size, generator=gen)
    live = torch.tensor([True, False, True, True, False, True, True, True])
    with interpreter(), batch_invariant():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), precision, _moe_kernels())
        results = []
        for max_tokens in (8, 3):  # one pass; passes of 3, 3 and 2 tokens
            monkeypatch.setattr(kernel_moe, "MOE_MAX_TOKENS", max_tokens)
            counts = torch.zeros(moe.num_experts, dtype=torch.long)
            masked_counts = torch.zeros(moe.num_experts, dtype=torch.long)
            results.append((moe(x, counts), counts, moe(x, masked_counts, live=live), masked_counts))
    (one, one_counts, one_masked, one_masked_counts), (passes, counts, masked, masked_counts) = results
    assert passes.shape == x.shape and torch.equal(counts, one_counts)
    assert torch.equal(masked_counts, one_masked_counts) and int(masked_counts.sum()) == 6 * moe.top_k
    # fp8: the kernel's rows are independent; fp32: bmm over other capacities, one order in the mode.
    assert torch.equal(passes, one) and torch.equal(masked, one_masked)
    assert torch.equal(masked[:, ~live], torch.zeros_like(masked[:, ~live]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dead_rows_route_nowhere_flash_layer():
    """A v41-s1 MoE layer (Flash shapes: D 5120, I 2304, top-6; 48 experts + shared), 64 rows, ~half
    dead: the live rows equal a call on them alone up to the FP8 GEMM's per-expert row grouping."""
    from model.deepseek_v41.moe import MoE
    from model.deepseek_v41.presets import V41_S1

    torch.manual_seed(0)
    with torch.device("cuda"):
        moe = MoE(V41_S1)
        with torch.no_grad():
            for name, p in moe.named_parameters():
                p.normal_(0.0, 0.01 if name == "gate_bias" else p.shape[-1] ** -0.5)
        kmoe = KernelMoE(moe, "fp8", KernelSet.compiled())
        del moe
        x = torch.randn(1, 64, V41_S1.hidden_size, dtype=torch.bfloat16)
        live = torch.rand(64) < 0.55
    check_live_mask(kmoe, x, live, tol=2e-2)  # bf16 outputs: 2^-7 relative per rounding
