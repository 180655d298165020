"""The accuracy harness (services/bench/accuracy.py): the kernel backend against the fp32 torch reference
by KL and top-1 agreement, the same plans replayed with the reference's tokens.

CPU: the harness end to end on the tiny preset: the torch runner against itself is exact (KL 0), a
perturbed model is not, and ``measure`` runs the FP8 copy then the in-place fp32 conversion (on the
kernels' torch references) without touching the reference model before the last step.
GPU: issue 8's FP8 criterion at V4.1's real widths (the 8-layer v41-s1 subset), and the tiny preset
for contrast.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from types import SimpleNamespace

import pytest
import torch

from kernels import reference
from services.bench.accuracy import TARGETS, Workload, compare, engine_config, make_prompts, measure, \
    meets_targets, record_reference, report, shared_copy, summarize
from services.bench.step_build import load_source, model_config
from services.worker.fp8_linear import KernelLinear
from services.worker.kernel_backend import convert_model
from services.worker.kernel_moe import KernelMoE
from services.worker.model_runner import ModelRunner
from tests.services.worker.test_kernel_backend import reference_kernels

SMALL = Workload(prompt_lens=(37, 20, 45), decode_steps=3, budget=24, block_size=16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def torch_reference_kernels():
    """test_kernel_backend's KernelSet of the kernels' torch references, with the prefill attention's
    reference where that set leaves the slot empty (the prefill rows then still run the FP8 formats)."""
    kernels = reference_kernels()
    if getattr(kernels, "prefill_attention", "absent") is None:
        def prefill(*args, dot_fp32=False, **_):
            return reference.sparse_prefill_attention(*args)

        kernels = dataclasses.replace(kernels, prefill_attention=SimpleNamespace(sparse_prefill_attention=prefill))
    return kernels


@pytest.fixture(scope="module")
def tiny():
    return load_source("tiny", model_config("tiny", None), "cpu", "torch").model


def test_torch_against_itself_is_exact_and_a_perturbed_model_is_not(tiny):
    config = engine_config(SMALL)
    prompts = make_prompts(tiny.cfg.vocab_size, SMALL)
    rec = record_reference(ModelRunner(tiny, config), SMALL, prompts)
    for rid, p in prompts.items():
        assert len(rec.seqs[rid]) == len(p) + SMALL.decode_steps + 1 and rec.seqs[rid][: len(p)] == p
    # Chunked: a budget of 24 cuts every prompt but the shortest.
    assert max(len(keys) for keys, _ in rec.steps) <= SMALL.budget and len(rec.steps) > SMALL.decode_steps + 3

    same = compare(rec, ModelRunner(tiny, config), SMALL)
    print("\n" + report("torch", same))
    n = len(prompts)
    assert same["all"]["positions"] == sum(SMALL.prompt_lens) + n * SMALL.decode_steps
    assert same["decode"]["positions"] == n * SMALL.decode_steps
    assert sum(s["positions"] for name, s in same.items() if name.startswith("ctx")) == same["all"]["positions"]
    for s in same.values():
        assert s["mean_kl"] == 0 and s["max_kl"] == 0 and s["top1_all"] == 1
    assert 0 < same["all"]["mean_entropy"] <= math.log(tiny.cfg.vocab_size) + 1e-9

    perturbed = copy.deepcopy(tiny)
    with torch.no_grad():
        perturbed.layers[2].attn.wo_b.weight.mul_(1.1)  # a ratio-2 KV source's output (no norm follows)
    moved = compare(rec, ModelRunner(perturbed, config), SMALL)
    print(report("perturbed", moved))
    assert moved["all"]["mean_kl"] > 1e-6 and moved["decode"]["max_kl"] > 0


def test_summary_groups_and_margin():
    rows = {"kl": torch.tensor([0.0, 1e-3, 2e-3, 4e-3, 0.02]), "entropy": torch.full((5,), 3.0, dtype=torch.float64),
            "margin": torch.tensor([0.01, 0.1, 0.2, 0.3, 0.04]), "agree": torch.tensor([False, True, False, True, True]),
            "position": torch.tensor([0, 300, 600, 1500, 2100]), "decode": torch.tensor([False] * 4 + [True])}
    s = summarize(rows)
    assert [name for name in s if name.startswith("ctx")] == ["ctx 1-256", "ctx 257-512", "ctx 513-1024",
                                                              "ctx 1025-2048", "ctx 2049-"]
    assert all(s[name]["positions"] == 1 for name in s if name.startswith("ctx"))
    assert (s["all"]["margin_rows"], s["all"]["top1"], s["all"]["top1_all"]) == (3, 2 / 3, 0.6)
    assert s["decode"]["top1"] is None and s["decode"]["max_kl"] == pytest.approx(0.02)
    assert s["prefill"]["mean_kl"] == pytest.approx(1.75e-3) and not meets_targets(s)


def test_measure_fp8_copy_then_fp32_in_place_on_the_kernel_references(tiny):
    model = copy.deepcopy(tiny)
    embed = model.embed.weight
    # The FP8 conversion of a shared copy leaves the original's modules (and tensors) as they were.
    twin = shared_copy(model)
    assert twin.embed.weight is embed and twin.layers[0].ffn.w1 is model.layers[0].ffn.w1
    convert_model(twin, "fp8", torch_reference_kernels())
    assert any(isinstance(m, KernelLinear) for m in twin.modules())
    assert not any(isinstance(m, (KernelLinear, KernelMoE)) for m in model.modules())
    del twin

    results = measure(model, SMALL, ("fp8", "fp32"), kernels=torch_reference_kernels())
    fp8, fp32 = results["fp8"]["all"], results["fp32"]["all"]
    assert fp8["positions"] == fp32["positions"] == sum(SMALL.prompt_lens) + len(SMALL.prompt_lens) * SMALL.decode_steps
    assert fp8["mean_kl"] > 1e-5  # the tiny model is hypersensitive to FP8 (test_kernel_backend: ~0.07)
    assert fp32["mean_kl"] < 1e-9 and fp32["top1"] == 1
    assert any(isinstance(m, KernelMoE) for m in model.modules())  # fp32 converted the model itself
    with pytest.raises(ValueError, match="last precision"):
        measure(tiny, SMALL, ("fp32", "fp8"))


# ---------------------------------------------------------------- GPU


def _dump(name: str, results) -> None:
    """Every summary as JSON under $FP8_ACCURACY_DIR, when set (for the report)."""
    if os.environ.get("FP8_ACCURACY_DIR"):
        with open(os.path.join(os.environ["FP8_ACCURACY_DIR"], f"fp8_accuracy_{name}.json"), "w") as f:
            json.dump(results, f, indent=1)


def _gpu_memory_gb() -> float:
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0


@pytest.mark.gpu
@pytest.mark.skipif(_gpu_memory_gb() < 100, reason="needs CUDA with ≥ 100 GB (the fp32 8-layer v41-s1 is ~60 GB)")
def test_gpu_fp8_accuracy_at_v41_width():
    """Issue 8's criterion on the 8-layer v41-s1 subset (one layer of every kind at Flash widths: hidden
    5120, index_topk 512 of up to 2000 compressed entries, top-6 of 48 experts): 4 prompts of
    600–2000 tokens prefilled in 1024-token chunks, then 32 greedy decode steps, every position.

    The tiny model misses the criterion by ~80× (test_kernel_backend: mean KL 0.08, top-1 60%) because
    its discrete choices (top-4 of a handful of entries, top-2 of 8 experts) flip under any rounding;
    at real widths a flip moves one of 512 entries or one of 6 experts. The issue's thresholds are
    asserted here as written. No measurement was available when this was written: if they fail, the
    printed table is the measured level, and the assertion becomes that level with a stated margin.
    The fp32 kernel path is held to fp32 noise (index/expert near-ties may flip a choice: generous)."""
    from services.bench.accuracy import run_preset

    results = run_preset("v41-s1", Workload(), ("fp8", "fp32"), torch.device("cuda"))
    _dump("v41-s1", results)
    fp8, fp32 = results["fp8"], results["fp32"]
    print({k: fp8[k] for k in ("all", "prefill", "decode")})
    assert fp8["decode"]["positions"] == 4 * 32 and fp8["all"]["margin_rows"] > 0
    assert fp32["all"]["mean_kl"] <= 1e-6 and fp32["all"]["max_kl"] <= 1e-4
    assert fp32["all"]["top1"] is None or fp32["all"]["top1"] >= 0.999
    assert fp8["all"]["mean_kl"] <= TARGETS["mean_kl"]
    assert fp8["all"]["max_kl"] <= TARGETS["max_kl"]
    assert fp8["all"]["top1"] >= TARGETS["top1"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_accuracy_tiny_contrast():
    """The tiny preset, same workload shape: printed for contrast with the v41 figures (its FP8 KL is
    far above the issue's targets, see above). Without test_kernel_backend's rounding replay, fp32 noise
    can move a cache or indexer value across an FP8/FP4 rounding edge and this model turns that into a
    flip: the fp32 kernel path is only held an order of magnitude below the FP8 one."""
    from services.bench.accuracy import run_preset

    results = run_preset("tiny", Workload(), ("fp8", "fp32"), torch.device("cuda"))
    _dump("tiny", results)
    assert results["fp32"]["all"]["mean_kl"] <= results["fp8"]["all"]["mean_kl"] / 10
