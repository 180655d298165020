"""``KernelMoE`` with routed experts kept MXFP4 (services/worker/kernel_model/fp4_experts.py), interpreted on CPU:
the released expert values kept exactly, dead rows routed nowhere, and the layer closer to the fp32 layer than
the FP8 experts' layer is."""

from __future__ import annotations

import copy

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from model.batch_invariant import batch_invariant
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.moe import KernelMoE
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_checkpoint_greedy_tokens_with_fp4_experts_equal_the_cpu_reference_where_fp8_do(tmp_path):
    """A ``shinkai model init`` checkpoint served on the GPU with FP4 experts and with FP8 experts, greedy, against
    the CPU fp32 engine: every prompt whose FP8 tokens equal the reference's has FP4 tokens equal to them too
    (a random tiny model's near-ties may part either path from the reference; FP4 must not part where FP8 holds)."""
    from services.engine import LLM, SamplingParams
    from services.entrypoints.cli import main

    ckpt = tmp_path / "tiny"
    assert main(["model", "init", "--preset", "tiny", "--out", str(ckpt), "--seed", "3", "--device", "cpu"]) == 0
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 2000, (n,), generator=gen).tolist() for n in (7, 19, 33, 60)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(block_size=16, max_num_seqs=4, max_model_len=256, batch_invariant=True)
    tokens = {}
    for name, extra in (("cpu", {"device": "cpu"}), ("fp8", {"expert_format": "fp8"}), ("fp4", {})):
        llm = LLM(model=str(ckpt), **kw, **({"device": "cuda"} | extra))
        tokens[name] = [out.token_ids for out in llm.generate(prompts, params)]
        del llm
    held = [i for i, (want, got) in enumerate(zip(tokens["cpu"], tokens["fp8"])) if want == got]
    print(f"\nprompts whose FP8 tokens equal the CPU reference's: {held} of {len(prompts)}")
    assert held, "no prompt where FP8 holds: nothing compared"
    assert all(tokens["fp4"][i] == tokens["cpu"][i] for i in held)
