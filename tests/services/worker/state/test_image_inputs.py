"""Images in the cached engine: the runner merges each request's image embeddings at its placeholder rows,
and with prefill chunks that start and end inside image spans it gives the full forward's logits exactly
(batch-invariant mode) at every position of every request, text-only requests in the same batch included."""

from __future__ import annotations

import pytest
import torch

from model.batch_invariant import batch_invariant
from model.deepseek_v41.init import random_checkpoint
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.tokenizer import engram_token_map
from model.deepseek_v41.vision import span_length, span_rows_cols
from scheduler_rs import Scheduler, SchedulerConfig
from services.engine.config import EngineConfig
from services.worker.runners.decode_step_graphs import DecodeStepGraphs
from services.worker.runners.model_runner import ModelRunner
from services.worker.state.image_inputs import ImageInputs
from tests.model.deepseek_v41.oracle_configs import VISION_CASES, finish
from tests.model.deepseek_v41.oracle_harness import toy_tokenizer
from tests.scheduler_rs.fake_worker import run_step

pytestmark = pytest.mark.usefixtures("one_torch_thread")
BLOCK, MAX_TOKENS = 16, 3


def test_step_rows_pick_each_rows_own_embedding():
    images = ImageInputs(9)
    images.put("a", [1, 9, 9, 9, 2, 9], torch.arange(4.0).unsqueeze(1))
    with pytest.raises(ValueError, match="3 image placeholder positions but"):
        images.put("b", [9, 9, 9], torch.zeros(2, 1))
    ids, positions = torch.tensor([9, 9, 2, 9, 5]), torch.tensor([2, 3, 4, 5, 0])
    mask, rows = images.step_rows(["c", "a"], ids, positions, torch.tensor([1, 1, 1, 1, 0]))
    assert mask.tolist() == [True, True, False, True, False] and rows.flatten().tolist() == [1.0, 2.0, 3.0]
    # The placeholder id outside a stored prompt position (sampled, or a request without images) is text.
    mask, rows = images.step_rows(["c", "a"], torch.tensor([9, 9]), torch.tensor([0, 7]), torch.tensor([0, 1]))
    assert mask is None and rows is None
    images.release("a")
    assert "a" not in images


def test_step_rows_of_text_requests_never_read_the_tensors():
    """A step whose requests hold no images answers from the ids alone: meta tensors (no data to read)
    would raise on any read, as a CUDA tensor would synchronise."""
    images = ImageInputs(9)
    images.put("a", [9], torch.zeros(1, 1))
    meta = torch.empty(3, dtype=torch.long, device="meta")
    assert images.step_rows(["b", "c"], meta, meta, meta) == (None, None)
    with pytest.raises(NotImplementedError):
        images.step_rows(["a"], meta, meta, meta)


@pytest.fixture(scope="module")
def vision_model():
    case = VISION_CASES[0]
    tok = toy_tokenizer(case.cfg.vocab_size)
    token_map, num = engram_token_map(tok)
    cfg = finish(case.cfg, num)
    model = DeepseekV41(cfg, token_map, num)
    assign_weights(model, random_checkpoint(cfg, case.seed))
    return model.eval()


def prompts(model: DeepseekV41) -> dict[str, tuple[list[int], list[tuple[int, int]]]]:
    """request → (prompt + fed-back tokens, the ViT grids of its images): one image, two images, none."""
    v = model.cfg.vision
    g = torch.Generator().manual_seed(4)

    def text(n: int) -> list[int]:
        return torch.randint(3, 240, (n,), generator=g).tolist()  # below the placeholder id 250

    def span(grid: tuple[int, int]) -> list[int]:
        return [v.image_token_id] * span_length(*span_rows_cols(grid, v.downsample_ratio))

    return {
        "one": (text(5) + span((5, 7)) + text(8) + text(MAX_TOKENS), [(5, 7)]),
        "two": (text(3) + span((7, 4)) + text(4) + span((2, 2)) + text(3) + text(MAX_TOKENS), [(7, 4), (2, 2)]),
        "none": (text(15) + text(MAX_TOKENS), []),
    }


@pytest.mark.parametrize("budget,graphs", [(7, False), (64, False), (7, True)])
def test_cached_engine_with_images_equals_the_full_forward_exactly(vision_model, budget, graphs):
    """``graphs``: the runner wrapped in a DecodeStepGraphs (its static decode step run eagerly, as on CPU), which
    takes the images for the wrapped runner."""
    model, cfg = vision_model, vision_model.cfg
    requests = prompts(model)
    spans = {}
    g = torch.Generator().manual_seed(5)
    p = cfg.vision.patch_size
    with torch.no_grad():
        for rid, (_, grids) in requests.items():
            if grids:
                patches = torch.rand(sum(h * w for h, w in grids), 3, p, p, generator=g) * 2 - 1
                spans[rid] = torch.cat(model.encoder(patches, grids))
    n = len(requests)
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=64,
        num_state_slots=n + 1,
        max_num_seqs=n,
        max_num_batched_tokens=budget,
        max_model_len=128,
        batch_invariant=True,
    ).worker_config()
    runner = ModelRunner(model, config)
    outer = DecodeStepGraphs(runner, config, use_graphs=False, attention="reference") if graphs else runner
    ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    sched = Scheduler(
        SchedulerConfig(
            block_size=BLOCK,
            num_blocks=64,
            num_state_slots=n + 1,
            max_num_seqs=n,
            max_num_batched_tokens=budget,
            max_model_len=128,
            window_size=cfg.sliding_window,
            compress_ratios=ratios,
        )
    )
    for rid, (seq, _) in requests.items():
        prompt = seq[:-MAX_TOKENS]
        if rid in spans:
            outer.set_images(rid, prompt, spans[rid])
        sched.add_request(rid, prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
    logits, cut_inside_a_span, num_steps = {}, False, 0
    while sched.has_unfinished():
        plan = sched.schedule()
        num_steps += 1
        out = outer.execute(plan, all_rows=True)
        positions, owners = plan.positions.tolist(), plan.row_requests.tolist()
        for row, (pos, i) in enumerate(zip(positions, owners)):
            logits[(plan.request_ids[i], pos)] = out.logits[row]
        for i, rid in enumerate(plan.request_ids):
            first = positions[plan.query_start[i]]
            seq = requests[rid][0]
            cut_inside_a_span |= (
                plan.is_prefill and 0 < first < len(seq) and seq[first - 1] == seq[first] == cfg.vision.image_token_id
            )
        sched.update(plan, run_step(plan, lambda rid, pos: requests[rid][0][pos]))
    for rid, (seq, _) in requests.items():
        ids = torch.tensor([seq[:-1]])
        with torch.no_grad(), batch_invariant():
            reference = model(ids, image_rows=spans.get(rid))[0]
        for pos in range(len(seq) - 1):
            assert torch.equal(logits[(rid, pos)], reference[pos]), f"{rid} position {pos}"
        outer.release(rid)
    assert not graphs or outer.num_eager < num_steps  # decode steps ran the static step
    assert runner.images is not None and not any(rid in runner.images for rid in requests)
    assert cut_inside_a_span == (budget < 64)
