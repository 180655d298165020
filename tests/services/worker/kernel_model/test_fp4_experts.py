"""``KernelMoE`` with routed experts kept MXFP4 (services/worker/kernel_model/fp4_experts.py), interpreted on CPU:
the released expert values kept exactly, dead rows routed nowhere, and the layer closer to the fp32 layer than
the FP8 experts' layer is."""

from __future__ import annotations

import copy

import pytest
import torch

from model.batch_invariant import batch_invariant
from services.worker.kernel_model.fp8_linear import KernelSet
from services.worker.kernel_model.moe import KernelMoE
from tests.kernels.interpret import interpreter, load_interpreted
from tests.services.worker.kernel_model.test_moe import check_live_mask
from tests.services.worker.runners.test_model_runner import case

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _kernels() -> KernelSet:
    names = ("rmsnorm", "quant_fp8", "moe_router", "moe_grouped_gemm", "decode_attention")
    modules = dict(zip(names, (load_interpreted(name) for name in names)))
    return KernelSet(**modules, moe_fp4=load_interpreted("moe_fp4"), interpreted=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def test_fp4_experts_keep_the_released_values_and_route_dead_rows_nowhere():
    model = case("oracle").model
    kernels = _kernels()
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 8, model.cfg.hidden_size, generator=gen)
    live = torch.tensor([True, True, False, True, False, True, True, False])
    with interpreter(), batch_invariant():
        moe = KernelMoE(copy.deepcopy(model.layers[1].ffn), "fp8", kernels, "fp4")
        assert moe.fp4 is not None and moe.fp4.routed_inexact == 0  # every routed value as released
        assert moe.fp4.w13.dtype == torch.uint8 and moe.fp4.w13.shape[-1] * 2 == moe.fp4.padded_hidden
        check_live_mask(moe, x, live, tol=0.0)


def test_fp4_layer_is_nearer_the_fp32_layer_than_the_fp8_layer():
    model = case("oracle").model
    kernels = _kernels()
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 24, model.cfg.hidden_size, generator=gen)
    ffn = model.layers[1].ffn
    with interpreter():
        want = KernelMoE(copy.deepcopy(ffn), "fp32", kernels)(x)
        fp4 = KernelMoE(copy.deepcopy(ffn), "fp8", kernels, "fp4")(x)
        fp8 = KernelMoE(copy.deepcopy(ffn), "fp8", kernels, "fp8")(x)
    assert _rel(fp4, want) < _rel(fp8, want)


def test_the_draft_experts_take_the_same_format():
    """``convert_model`` with ``expert_format="fp4"`` keeps every MoE's routed experts MXFP4, the DSpark draft's
    stages included, each exactly as released."""
    from services.engine.model_source import load_model
    from services.worker.kernel_model.backend import convert_model

    model = load_model("tiny").model
    assert model.draft is not None
    done = convert_model(model, "fp8", _kernels(), "fp4")
    moes = [m for m in model.modules() if isinstance(m, KernelMoE)]
    draft = [m for m in model.draft.modules() if isinstance(m, KernelMoE)]
    assert done.draft_moes == len(draft) > 0 and len(moes) == done.moes
    assert all(m.fp4 is not None and m.fp4.routed_inexact == 0 for m in moes)
