"""``KernelMoE`` with image-span tokens (services/worker/kernel_moe.py), and the kernel backend's engine on a
prompt with images, under Triton's interpreter on CPU.

The image tokens of a prompt select their experts with the gate's ``bias_vl`` (model/deepseek_v41/moe.py);
the vision model's random ``bias_vl`` is independent of its ``gate_bias`` (0.3·N(0, 1) each), so a router
that ignored the mask would pick other experts for most image tokens and the checks below would fail.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from model.deepseek_v41.init import random_checkpoint
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.tokenizer import engram_token_map
from model.deepseek_v41.vision import span_length, span_rows_cols
from scheduler_rs import Scheduler, SchedulerConfig
from services.engine.config import EngineConfig
from services.worker.fp8_linear import KernelSet
from services.worker.kernel_moe import KernelMoE
from services.worker.model_runner import ModelRunner
from tests import tolerances as tol
from tests.kernels.interpret import interpreter, load_interpreted
from tests.model.deepseek_v41.oracle_configs import VISION_CASES, finish
from tests.model.deepseek_v41.oracle_harness import toy_tokenizer
from tests.scheduler_rs.fake_worker import run_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py
BLOCK, MAX_TOKENS, BUDGET = 16, 1, 64


def interpreted() -> KernelSet:
    return KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)


@pytest.fixture(scope="module")
def vision_model() -> DeepseekV41:
    """vision-a's tower and layers, cut to 4 layers with each kind once (sliding window only; Engram with
    ratio-2 entries; ratio-1 entries with the indexer and candidates; sliding window), so every kernel of
    a step runs under the interpreter in half of the 8-layer model's time."""
    case = VISION_CASES[0]
    token_map, num = engram_token_map(toy_tokenizer(case.cfg.vocab_size))
    cfg = dataclasses.replace(case.cfg, num_hidden_layers=4, compress_ratios=(0, 2, 1, 0, 0),
                              kv_source_layer_ids=(1, 2), index_source_layer_ids=(1, 2), candidate_source_layer_id=2,
                              engram_layer_ids=(1,), engram_num_embeddings=(1,))
    cfg = finish(cfg, num)
    model = DeepseekV41(cfg, token_map, num)
    assign_weights(model, random_checkpoint(cfg, case.seed))
    return model.eval()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("precision", ["fp32", "fp8"])
def test_kernel_moe_with_an_image_mask_routes_like_the_model(vision_model, precision):
    moe = vision_model.layers[1].ffn
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(1, 19, vision_model.cfg.hidden_size, generator=gen)
    image = torch.zeros(1, 19, dtype=torch.bool)
    image[0, 3:12] = True
    counts_ref, counts_text = (torch.zeros(moe.w1.shape[0], dtype=torch.long) for _ in range(2))
    counts = torch.zeros_like(counts_ref)
    with torch.no_grad():
        ref = moe(x, counts_ref, image=image)
        moe(x, counts_text)
    kmoe = KernelMoE(moe, precision, interpreted())
    with interpreter():
        out = kmoe(x, counts, image=image)
    assert torch.equal(counts, counts_ref)  # the model's picks (bias_vl for the image rows), counted alike
    assert not torch.equal(counts_ref, counts_text)  # ... which the mask changed
    # fp32: only the summation order differs; fp8: four e4m3 casts, as test_kernel_backend.py's MoE check.
    assert _rel(out, ref) < (tol.FP32_REORDER_REL if precision == "fp32" else 0.1)


def _requests(model: DeepseekV41) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """request → prompt + one fed-back token, and the image request's span embeddings: short prompts, since
    every kernel runs under the interpreter (one image of 10 placeholders among 7 text tokens; text only)."""
    v = model.cfg.vision
    g = torch.Generator().manual_seed(8)

    def text(n: int) -> list[int]:
        return torch.randint(3, v.image_token_id, (n,), generator=g).tolist()

    grid = (5, 7)
    seqs = {"image": text(4) + [v.image_token_id] * span_length(*span_rows_cols(grid, v.downsample_ratio)) + text(3)
            + text(MAX_TOKENS), "text": text(9) + text(MAX_TOKENS)}
    p = v.patch_size
    with torch.no_grad():
        patches = torch.rand(grid[0] * grid[1], 3, p, p, generator=g) * 2 - 1
        spans = {"image": torch.cat(model.encoder(patches, [grid]))}
    return seqs, spans


def _drive(runner: ModelRunner, model: DeepseekV41, seqs: dict[str, list[int]], spans: dict[str, torch.Tensor]
           ) -> tuple[dict[tuple[str, int], torch.Tensor], torch.Tensor]:
    """Every request through the real scheduler and ``runner`` (one prefill step: the budget holds every
    prompt): logits per (request, position) and the step's expert counts [layers, experts]."""
    cfg, n = model.cfg, len(seqs)
    ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    sched = Scheduler(SchedulerConfig(block_size=BLOCK, num_blocks=64, num_state_slots=n + 1, max_num_seqs=n,
                                      max_num_batched_tokens=BUDGET, max_model_len=128,
                                      window_size=cfg.sliding_window, compress_ratios=ratios))
    for rid, seq in seqs.items():
        if rid in spans:
            runner.set_images(rid, seq[:-MAX_TOKENS], spans[rid])
        sched.add_request(rid, seq[:-MAX_TOKENS], max_tokens=MAX_TOKENS, ignore_eos=True)
    plan = sched.schedule()
    assert plan.is_prefill and plan.num_rows == sum(len(seq) - MAX_TOKENS for seq in seqs.values())
    out = runner.execute(plan, all_rows=True)
    logits = {(plan.request_ids[i], pos): out.logits[row].float().cpu()
              for row, (pos, i) in enumerate(zip(plan.positions.tolist(), plan.row_requests.tolist()))}
    sched.update(plan, run_step(plan, lambda rid, pos: seqs[rid][pos]))
    for rid in seqs:
        sched.abort(rid)
        runner.release(rid)
    return logits, out.expert_counts.cpu()


def _runner(model: DeepseekV41, num_requests: int, backend: str, precision: str | None = None,
            kernels: KernelSet | None = None) -> ModelRunner:
    config = EngineConfig(block_size=BLOCK, num_blocks=64, num_state_slots=num_requests + 1,
                          max_num_seqs=num_requests, max_num_batched_tokens=BUDGET, max_model_len=128,
                          batch_invariant=True).worker_config()
    return ModelRunner(copy.deepcopy(model), config, backend=backend, precision=precision, kernels=kernels)


def _kl(ours: dict, ref: dict) -> tuple[float, float]:
    """(mean, max) over positions of KL(reference ‖ ours)."""
    kls = []
    for key, r in ref.items():
        p = r.double().log_softmax(-1)
        kls.append(float((p.exp() * (p - ours[key].double().log_softmax(-1))).sum()))
    return sum(kls) / len(kls), max(kls)


def test_fp32_kernel_engine_with_an_image_equals_the_torch_backend(vision_model):
    """The whole kernel engine (fp32 weights, every kernel interpreted) on a batch of an image prompt and a
    text prompt, against the torch backend on the same plan: the same experts chosen in every layer
    (image tokens with ``bias_vl``) and the logits within summation-order noise, the existing fp32 engine
    bound (test_kernel_backend.py: ``PREFIX_ATOL``)."""
    seqs, spans = _requests(vision_model)
    want, want_counts = _drive(_runner(vision_model, 2, "torch"), vision_model, seqs, spans)
    with interpreter():
        got, counts = _drive(_runner(vision_model, 2, "kernels", "fp32", interpreted()), vision_model, seqs, spans)
    assert torch.equal(counts, want_counts)
    worst = max(float((got[key] - want[key]).abs().max()) for key in want)
    print(f"\nfp32 kernel engine with an image vs the torch backend: max |Δ| {worst:.3g} over {len(want)} positions")
    assert worst <= tol.PREFIX_ATOL


def test_fp8_kernel_engine_with_an_image_is_batch_invariant_and_within_the_fp8_floor(vision_model):
    """The FP8 kernel engine (interpreted, batch-invariant mode): the image prompt's logits alone equal its
    logits beside a text prompt (``==``), and against the torch backend they are as close as the FP8
    formats allow, by test_kernel_backend.py's FP8 bound: mean and max KL no worse than twice the same
    wiring's on the torch references (``KernelSet.references()``, the format floor), or issue 8's targets."""
    seqs, spans = _requests(vision_model)
    want, _ = _drive(_runner(vision_model, 2, "torch"), vision_model, seqs, spans)
    floor, _ = _drive(_runner(vision_model, 2, "kernels", "fp8", KernelSet.references()), vision_model, seqs, spans)
    kernels = interpreted()
    with interpreter():
        batch, _ = _drive(_runner(vision_model, 2, "kernels", "fp8", kernels), vision_model, seqs, spans)
        alone, _ = _drive(_runner(vision_model, 1, "kernels", "fp8", kernels), vision_model,
                          {"image": seqs["image"]}, spans)
    assert alone.keys() == {key for key in batch if key[0] == "image"}
    assert all(torch.equal(alone[key], batch[key]) for key in alone)
    (mean, worst), (floor_mean, floor_worst) = _kl(batch, want), _kl(floor, want)
    print(f"\nfp8 kernel engine with an image vs the torch backend: mean KL {mean:.3g}, max {worst:.3g}; "
          f"FP8-format floor {floor_mean:.3g}, {floor_worst:.3g}")
    assert mean <= max(1e-3, 2 * floor_mean) and worst <= max(1e-2, 2 * floor_worst)
