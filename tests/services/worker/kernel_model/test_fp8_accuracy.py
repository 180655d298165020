"""The accuracy harness (services/bench/accuracy.py): the kernel backend against the fp32 torch reference
by KL and top-1 agreement, the same plans replayed with the reference's tokens.

CPU: the harness end to end on the tiny preset: the torch runner against itself is exact (KL 0), a
perturbed model is not, and ``measure`` runs the FP8 copy then the in-place fp32 conversion (on the
kernels' torch references) without touching the reference model before the last step. The FP8 accuracy
criterion itself on test_kernel_backend's three tiny FP8 configs with the residual branches × 2^-4
(``scale_branches``: contractive, as trained models are): the FP8 formats meet it; the loud init does not.
GPU: the kernel backend's FP8 path at 2^-4 on those configs and on the 8-layer v41-s1 subset; the loud
init at V4.1's real widths and on the tiny preset, for contrast.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os

import pytest
import torch

from services.bench.accuracy import (
    FORMAT_FLOOR,
    TARGETS,
    Workload,
    compare,
    engine_config,
    make_prompts,
    measure,
    meets_targets,
    record_reference,
    report,
    row_stats,
    scale_branches,
    shared_copy,
    summarize,
)
from services.bench.step.build import load_source, model_config
from services.worker.kernel_model.backend import convert_model
from services.worker.kernel_model.fp8_linear import KernelLinear
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.moe import KernelMoE
from services.worker.runners.model_runner import ModelRunner
from tests.services.worker.kernel_model import test_backend as backend_tests

SMALL = Workload(prompt_lens=(37, 20, 45), decode_steps=3, budget=24, block_size=16)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load_source("tiny", model_config("tiny", None), "cpu", "torch").model


def test_torch_against_itself_is_exact_and_a_perturbed_model_is_not(tiny):
    config = engine_config(SMALL).worker_config()
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
    rows = {
        "kl": torch.tensor([0.0, 1e-3, 2e-3, 4e-3, 0.02]),
        "entropy": torch.full((5,), 3.0, dtype=torch.float64),
        "margin": torch.tensor([0.01, 0.1, 0.2, 0.3, 0.04]),
        "agree": torch.tensor([False, True, False, True, True]),
        "position": torch.tensor([0, 300, 600, 1500, 2100]),
        "decode": torch.tensor([False] * 4 + [True]),
    }
    s = summarize(rows)
    assert [name for name in s if name.startswith("ctx")] == [
        "ctx 1-256",
        "ctx 257-512",
        "ctx 513-1024",
        "ctx 1025-2048",
        "ctx 2049-",
    ]
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
    convert_model(twin, "fp8", KernelSet.references())
    assert any(isinstance(m, KernelLinear) for m in twin.modules())
    assert not any(isinstance(m, (KernelLinear, KernelMoE)) for m in model.modules())
    del twin

    results = measure(model, SMALL, ("fp8", FORMAT_FLOOR, "fp32"), kernels=KernelSet.references())
    fp8, fp32 = results["fp8"]["all"], results["fp32"]["all"]
    assert results[FORMAT_FLOOR]["all"] == fp8  # the named floor is the reference set, here also passed as kernels
    assert fp8["positions"] == fp32["positions"] == sum(SMALL.prompt_lens) + len(SMALL.prompt_lens) * SMALL.decode_steps
    assert fp8["mean_kl"] > 1e-5  # the tiny model is hypersensitive to FP8 (test_kernel_backend: ~0.07)
    # The fp32 path differs from the reference by summation order only, so its KL sits below FP8's by at least the
    # ratio of the formats' unit roundoffs, 2^-24 / 2^-4 (not squared, as KL would be in a smooth model: the loud
    # init amplifies order noise by machine-dependent amounts; 1.2e-9 on an AMD EPYC against fp8's 0.099).
    assert fp32["mean_kl"] <= 2.0**-20 * fp8["mean_kl"] and fp32["top1"] == 1
    assert any(isinstance(m, KernelMoE) for m in model.modules())  # fp32 converted the model itself
    with pytest.raises(ValueError, match="last precision"):
        measure(tiny, SMALL, ("fp32", "fp8"))


# ---------------------------------------------------------------- the FP8 targets on a contractive model

BRANCH_SCALE_LOG2 = 4
"""Residual branches × 2^-4: docs/accuracy.md §3, the smallest scale at which the FP8 formats meet the
FP8 accuracy targets on the tiny configs (2^-3: mean KL 2.0e-3, max 0.022)."""


def _scaled_case(name: str, branch_scale_log2: int | None):
    """test_kernel_backend's config ``name`` (test_model_runner's model and requests) with its branches
    scaled, its full-sequence reference recomputed; also the ids [B, S] and fed positions [B, S]."""
    c = backend_tests.case(name)
    model = copy.deepcopy(c.model)
    scale_branches(model, branch_scale_log2)
    fed = [s[:-1] for s in c.seqs.values()]  # the last sampled token is never fed
    ids = torch.zeros(len(fed), max(map(len, fed)), dtype=torch.long)
    valid = torch.zeros(ids.shape, dtype=torch.bool)
    for b, s in enumerate(fed):
        ids[b, : len(s)], valid[b, : len(s)] = torch.tensor(s), True
    with torch.no_grad():
        reference_logits = model(ids)  # [B, S, V]
    return dataclasses.replace(c, model=model, reference=reference_logits), ids, valid


def _scaled_reports(
    branch_scale_log2: int | None, device: str, kernels, expert_format: str = "fp8"
) -> dict[str, float]:
    """KL(fp32 full-sequence reference ‖ FP8 engine) over every position of the three FP8 configs (chunked
    prefill and decode, test_kernel_backend's budgets), pooled as its ``_fp8_reports``; plus the reference's
    mean entropy and "moved": mean KL(reference ‖ the same model with the branches × 0)."""
    reports, entropy, moved = [], [], []
    for name, budget in backend_tests.FP8_CASES:
        c, ids, valid = _scaled_case(name, branch_scale_log2)
        model = copy.deepcopy(c.model).to(device)
        runner = backend_tests.runner_for(c, model, budget, "fp8", kernels, expert_format=expert_format)
        reports.append(backend_tests._kl_report(c, backend_tests.drive(c, runner, budget)))
        zeroed = copy.deepcopy(c.model)
        scale_branches(zeroed, None)
        with torch.no_grad():
            stats = row_stats(c.reference[valid], zeroed(ids)[valid])
        entropy.append(stats["entropy"])
        moved.append(stats["kl"])
    positions = sum(r["positions"] for r in reports)
    margin_rows = sum(r["margin_rows"] for r in reports)
    return {
        "mean_kl": sum(r["mean_kl"] * r["positions"] for r in reports) / positions,
        "max_kl": max(r["max_kl"] for r in reports),
        "top1": sum(r["top1"] * r["margin_rows"] for r in reports) / margin_rows,
        "margin_rows": margin_rows,
        "positions": positions,
        "entropy": float(torch.cat(entropy).mean()),
        "moved": float(torch.cat(moved).mean()),
        "per_config": [round(r["mean_kl"], 6) for r in reports],
    }


def test_fp8_formats_meet_the_targets_on_a_contractive_model_and_not_on_the_loud_init():
    """The FP8 formats (test_kernel_backend's torch-reference kernel set: the same wiring and roundings as
    the GPU kernels) through the cached engine. At 2^-4 (381 positions): mean KL
    4.0e-4, max 6.9e-3, top-1 99.1% (329 of 332 margin rows), reference entropy 5.02 of ln V 5.55, KL to
    the branches-zeroed model 0.015. The loud init (× 1): mean 0.080, max 0.42, top-1 57%, moved 0.70.
    The pass is not a trivialised model: the reference stays far from uniform and the layers still move
    it (the KL to the embedding-only model is 40× the FP8 KL)."""
    vocab_size = backend_tests.case(backend_tests.FP8_CASES[0][0]).model.cfg.vocab_size
    scaled = _scaled_reports(BRANCH_SCALE_LOG2, "cpu", KernelSet.references())
    loud = _scaled_reports(0, "cpu", KernelSet.references())
    print(f"\nFP8 formats, branches × 2^-{BRANCH_SCALE_LOG2}: {scaled}\nFP8 formats, loud init: {loud}")
    assert scaled["positions"] == loud["positions"] == 381
    assert scaled["mean_kl"] <= TARGETS["mean_kl"] and scaled["max_kl"] <= TARGETS["max_kl"]
    assert scaled["top1"] >= TARGETS["top1"]
    assert scaled["entropy"] <= 0.95 * math.log(vocab_size)
    assert scaled["moved"] >= 1e-3 and scaled["moved"] >= 10 * scaled["mean_kl"]
    assert not meets_targets({"all": loud})  # the chaotic init: the harness can fail
    assert loud["mean_kl"] > 10 * TARGETS["mean_kl"]


# ---------------------------------------------------------------- GPU


def _dump(name: str, results) -> None:
    """Every summary as JSON under $FP8_ACCURACY_DIR, when set (for the report)."""
    if os.environ.get("FP8_ACCURACY_DIR"):
        with open(os.path.join(os.environ["FP8_ACCURACY_DIR"], f"fp8_accuracy_{name}.json"), "w") as f:
            json.dump(results, f, indent=1)


def _gpu_memory_gb() -> float:
    return torch.cuda.get_device_properties(0).total_memory / 2**30 if torch.cuda.is_available() else 0.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_engine_meets_the_targets_on_the_contractive_tiny_configs():
    """The compiled kernel backend's FP8 path (every kernel) on the CPU test's three configs at branch
    scale 2^-4 against the CPU fp32 full-sequence reference: the FP8 accuracy thresholds as written. The torch
    references meet them (test above); a kernel defect that the loud init hides in its own noise shows
    here, as the prefill attention defect (BLOCK_N 16 at D 64) did (docs/accuracy.md)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = _scaled_reports(BRANCH_SCALE_LOG2, "cuda", None)
    print(f"\nGPU FP8 kernel engine, branches × 2^-{BRANCH_SCALE_LOG2}: {gpu}")
    assert gpu["positions"] == 381
    assert gpu["mean_kl"] <= TARGETS["mean_kl"] and gpu["max_kl"] <= TARGETS["max_kl"]
    assert gpu["top1"] >= TARGETS["top1"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp4_experts_meet_the_targets_on_the_contractive_tiny_configs():
    """The same criterion with the routed experts kept MXFP4 (kernels/moe_fp4.py: exact weights, bf16
    activations into the experts): the thresholds as written; the FP8 experts' figures printed beside."""
    torch.backends.cuda.matmul.allow_tf32 = False
    fp4 = _scaled_reports(BRANCH_SCALE_LOG2, "cuda", None, "fp4")
    fp8 = _scaled_reports(BRANCH_SCALE_LOG2, "cuda", None, "fp8")
    print(f"\nGPU FP4 experts, branches × 2^-{BRANCH_SCALE_LOG2}: {fp4}\nFP8 experts: {fp8}")
    assert fp4["positions"] == 381
    assert fp4["mean_kl"] <= TARGETS["mean_kl"] and fp4["max_kl"] <= TARGETS["max_kl"]
    assert fp4["top1"] >= TARGETS["top1"]


V41_GPU = pytest.mark.skipif(
    _gpu_memory_gb() < 100, reason="needs CUDA with ≥ 100 GB (the fp32 8-layer v41-s1 is ~60 GB)"
)


@pytest.mark.gpu
@V41_GPU
def test_gpu_fp8_accuracy_at_v41_width_contractive():
    """The FP8 accuracy criterion on the 8-layer v41-s1 subset (one layer of every kind at Flash widths: hidden
    5120, index_topk 512 of up to 2000 compressed entries, top-6 of 48 experts) with the residual
    branches × 2^-4 (``scale_branches``; contractive, as trained models are): 4 prompts of 600–2000
    tokens prefilled in 1024-token chunks, then 32 greedy decode steps, every position; ``measure``
    prints the table per group. The thresholds are asserted as written, for FP8 and for the fp32 kernel
    path (summation-order noise, ~1e-7, through a contractive model: expected far below them). The
    random head keeps v41's reference near-uniform (loud init: 11.25 nats of ln V 11.77), so its
    entropy is printed, not bounded: the tiny test carries the non-triviality checks.
    Measured (docs/accuracy.md), the FP8 kernels' max KL is the formats' (FORMAT_FLOOR's), not a kernel's:
    that one threshold is held at the floor's max when the floor is above it."""
    from services.bench.accuracy import run_preset

    results = run_preset("v41-s1", Workload(), ("fp8", FORMAT_FLOOR, "fp32"), torch.device("cuda"), BRANCH_SCALE_LOG2)
    _dump(f"v41-s1-branch-scale-2-{BRANCH_SCALE_LOG2}", results)
    fp8, floor, fp32 = (results[p]["all"] for p in ("fp8", FORMAT_FLOOR, "fp32"))
    assert results["fp8"]["decode"]["positions"] == 4 * 32 and fp8["margin_rows"] > 0
    for label, s in (("fp8", fp8), (FORMAT_FLOOR, floor), ("fp32", fp32)):
        print(
            f"{label}: mean KL {s['mean_kl']:.3g}, max KL {s['max_kl']:.3g}, top-1 {s['top1']}, ref H "
            f"{s['mean_entropy']:.3f}"
        )
    # fp32 kernels: the thresholds as written. FP8: as written, except that the max may reach the
    # formats' own max (the kernels cannot go below the formats they compute in).
    assert fp32["mean_kl"] <= TARGETS["mean_kl"] and fp32["max_kl"] <= TARGETS["max_kl"]
    assert fp32["top1"] >= TARGETS["top1"]
    assert fp8["mean_kl"] <= TARGETS["mean_kl"] and fp8["top1"] >= TARGETS["top1"]
    assert fp8["max_kl"] <= max(TARGETS["max_kl"], 1.1 * floor["max_kl"])


@pytest.mark.gpu
@V41_GPU
def test_gpu_fp8_accuracy_at_v41_width():
    """The loud random init (branches × 1) on the 8-layer v41-s1 subset, same workload: a regression
    check, not the FP8 accuracy targets (its measured KL: docs/accuracy.md). The fp32 kernel path (fp32
    weights and dots, differing from the reference by summation order) is far from the reference too: the
    chaotic init turns ~1e-7 into discrete flips (docs/accuracy.md), so the fp32 path gets no bound here (the old 1e-6
    was a guess; its bound is the contractive test's). FP8 is held to 1.5× its measured mean."""
    from services.bench.accuracy import run_preset

    results = run_preset("v41-s1", Workload(), ("fp8", "fp32"), torch.device("cuda"))
    _dump("v41-s1", results)
    fp8, fp32 = results["fp8"], results["fp32"]
    print({k: fp8[k] for k in ("all", "prefill", "decode")})
    assert fp8["decode"]["positions"] == 4 * 32 and fp8["all"]["margin_rows"] > 0
    assert fp8["all"]["mean_kl"] <= 0.15
    assert fp32["all"]["mean_kl"] <= fp8["all"]["mean_kl"] / 10


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_fp8_accuracy_tiny_contrast():
    """The tiny preset, same workload shape: printed for contrast with the v41 figures (its FP8 KL is
    far above the accuracy targets, see above). Without test_kernel_backend's rounding replay, fp32 noise
    can move a cache or indexer value across an FP8/FP4 rounding edge and this model turns that into a
    flip: the fp32 kernel path is only held an order of magnitude below the FP8 one."""
    from services.bench.accuracy import run_preset

    results = run_preset("tiny", Workload(), ("fp8", "fp32"), torch.device("cuda"))
    _dump("tiny", results)
    assert results["fp32"]["all"]["mean_kl"] <= results["fp8"]["all"]["mean_kl"] / 10


def test_shinkai_bench_accuracy_parses_its_options():
    """`shinkai bench accuracy --presets … --precisions …` reaches the harness (it once swallowed every
    option); without CUDA it stops with a message, not a parse error."""
    from services.entrypoints.cli import main

    if torch.cuda.is_available():
        pytest.skip("on CUDA this would run the whole measurement")
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        main(
            [
                "bench",
                "accuracy",
                "--presets",
                "tiny",
                "--precisions",
                f"fp8,{FORMAT_FLOOR},fp32",
                "--branch-scale-log2",
                "4",
            ]
        )
    with pytest.raises(SystemExit) as bad:
        main(["bench", "accuracy", "--no-such-option"])
    assert bad.value.code == 2
