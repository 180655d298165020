"""The vision tower in the model: span layout, the tiny preset's tower appended without moving any text
weight or output, placeholder merging, image tokens dead for Engram and routed with ``bias_vl``, and the
encoder's batch invariance (one image alone vs in a batch of 8)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.batch_invariant import batch_invariant
from model.deepseek_v41 import engram as engram_module
from model.deepseek_v41.checkpoint import tensor_table
from model.deepseek_v41.config import from_hf_dict, to_hf_dict
from model.deepseek_v41.init import random_checkpoint
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.vision import IMAGE, IMAGE_END, IMAGE_NEWLINE, IMAGE_START, span_kinds, span_length
from model.deepseek_v41.vision_config import IMAGE_TOKEN_ID, VisionConfig

TEXT_ONLY = dataclasses.replace(TINY, vision=None)
GRIDS = [(5, 7), (3, 3), (1, 2), (7, 4), (6, 6), (2, 9), (4, 4), (8, 3)]  # ViT patch grids (h, w)


def patches_for(grids, seed=0) -> torch.Tensor:
    n = sum(h * w for h, w in grids)
    p = TINY.vision.patch_size
    return torch.rand(n, 3, p, p, generator=torch.Generator().manual_seed(seed)) * 2 - 1


def prompt(span: int) -> torch.Tensor:
    """[1, S]: a few text tokens, one image span of ``span`` placeholders, more text."""
    return torch.tensor([[0, 128799, 19923, 128803] + [IMAGE_TOKEN_ID] * span + [19923, 16, 128804, 128821]])


def test_span_layout_is_start_rows_with_newlines_end():
    assert span_kinds(2, 3) == [
        IMAGE_START,
        IMAGE,
        IMAGE,
        IMAGE,
        IMAGE_NEWLINE,
        IMAGE,
        IMAGE,
        IMAGE,
        IMAGE_NEWLINE,
        IMAGE_END,
    ]
    assert span_length(2, 3) == 10 == len(span_kinds(2, 3))


def test_vision_config_round_trips_and_refuses_bad_fields():
    assert from_hf_dict(to_hf_dict(TINY)) == TINY
    assert from_hf_dict(to_hf_dict(TEXT_ONLY)).vision is None
    with pytest.raises(ValueError, match="multiple of 4"):
        VisionConfig(hidden_size=30, num_attention_heads=3)
    with pytest.raises(ValueError, match="image_token_id"):  # no draft: its noise token is outside too
        dataclasses.replace(TINY, vocab_size=1000, num_nextn_predict_layers=0)


def test_tiny_vision_tensors_come_after_every_text_tensor_and_change_none():
    names = list(tensor_table(TINY))
    text = list(tensor_table(TEXT_ONLY))
    assert names[: len(text)] == text
    assert all(n.startswith(("vision.", "aligner.", "image_")) for n in names[len(text) :])
    with_vision, without = random_checkpoint(TINY, 3), random_checkpoint(TEXT_ONLY, 3)
    assert set(without) < set(with_vision)
    for name, value in without.items():
        assert torch.equal(value.view(torch.uint8), with_vision[name].view(torch.uint8)), name


def test_text_logits_do_not_change_with_the_tower(tiny_model):
    text_only = DeepseekV41(TEXT_ONLY, tiny_model.model.hasher.token_map, TINY.engram_compressed_vocab_size)
    tensors = {
        k: v for k, v in random_checkpoint(TINY, 5).items() if not k.startswith(("vision.", "aligner.", "image_"))
    }
    assign_weights(text_only, tensors)
    ids = torch.randint(3, 128000, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(text_only.eval()(ids), tiny_model.model(ids))


def test_placeholders_need_exactly_their_embedding_rows(tiny_model):
    model = tiny_model.model
    ids = prompt(10)
    with pytest.raises(ValueError, match="10 image placeholder positions but 0"):
        model(ids)
    with pytest.raises(ValueError, match="10 image placeholder positions but 9"):
        model(ids, image_rows=torch.zeros(9, TINY.hidden_size))


def test_spans_fill_the_placeholders_and_change_the_logits(tiny_model):
    model = tiny_model.model
    with torch.no_grad():
        (span,) = model.encoder(patches_for([(5, 7)]), [(5, 7)])
        assert span.shape == (10, TINY.hidden_size)
        assert torch.equal(span[0], model.encoder.image_start) and torch.equal(span[-1], model.encoder.image_end)
        assert torch.equal(span[4], model.encoder.image_newline) and torch.equal(span[8], model.encoder.image_newline)
        e, image = model.embed_inputs(prompt(10), span)
        assert torch.equal(e[0, 4:14], span) and torch.equal(e[0, :4], model.embed(prompt(10)[:, :4])[0])
        assert image[0].tolist() == [False] * 4 + [True] * 10 + [False] * 4
        (other,) = model.encoder(patches_for([(5, 7)], seed=1), [(5, 7)])
        with batch_invariant():  # so positions before the image compute bit for bit alike
            a, b = model(prompt(10), image_rows=span), model(prompt(10), image_rows=other)
    assert torch.equal(a[:, :4], b[:, :4])  # causal: text before the image is untouched
    assert float((a[:, 4:] - b[:, 4:]).abs().max()) > 1e-2


def test_image_tokens_are_dead_for_engram(tiny_model, monkeypatch):
    seen = []
    original = engram_module.Engram.forward

    def spy(self, h, rows, live=None):
        seen.append(live)
        return original(self, h, rows, live)

    monkeypatch.setattr(engram_module.Engram, "forward", spy)
    model = tiny_model.model
    with torch.no_grad():
        span = model.encoder(patches_for([(5, 7)]), [(5, 7)])[0]
        model(prompt(10), image_rows=span)
    expected = torch.tensor([[True] * 4 + [False] * 10 + [True] * 4])
    assert len(seen) == len(TINY.engram_layer_ids) and all(torch.equal(live, expected) for live in seen)


def test_image_tokens_select_experts_with_bias_vl():
    moe = MoE(TINY)
    with torch.no_grad():
        moe.gate_weight.normal_(generator=torch.Generator().manual_seed(0))
        moe.bias_vl[3], moe.bias_vl[5] = 100.0, -100.0  # every image token picks expert 3, none picks 5
        moe.gate_bias[5], moe.gate_bias[3] = 100.0, -100.0  # every text token picks expert 5, none picks 3
    x = torch.randn(6, TINY.hidden_size, generator=torch.Generator().manual_seed(1))
    image = torch.tensor([False, True, True, False, True, False])
    _, experts = moe.route(x, image)
    assert ((experts == 3).any(-1) == image).all() and ((experts == 5).any(-1) == ~image).all()
    _, text_experts = moe.route(x)
    assert (text_experts == 5).any(-1).all()


def test_bias_vl_moves_image_prompts_only(tiny_model):
    model = tiny_model.model
    text = torch.randint(3, 128000, (1, 18), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        span = model.encoder(patches_for([(5, 7)]), [(5, 7)])[0]
        before_image, before_text = model(prompt(10), image_rows=span), model(text)
        saved = [block.ffn.bias_vl.clone() for block in model.layers]
        try:
            for block in model.layers:
                block.ffn.bias_vl.copy_(
                    torch.randn(block.ffn.bias_vl.shape, generator=torch.Generator().manual_seed(3))
                )
            after_image, after_text = model(prompt(10), image_rows=span), model(text)
        finally:
            for block, bias in zip(model.layers, saved):
                block.ffn.bias_vl.copy_(bias)
    assert torch.equal(before_text, after_text)
    assert float((after_image - before_image).abs().max()) > 1e-2


def test_an_image_alone_equals_it_in_a_batch_of_8(tiny_model):
    encoder = tiny_model.model.encoder
    patches = patches_for(GRIDS)
    with torch.no_grad():
        batch = encoder(patches, GRIDS)
        start = 0
        for grid, span in zip(GRIDS, batch):
            n = grid[0] * grid[1]
            alone = encoder(patches[start : start + n], [grid])[0]
            # Outside the mode the GEMMs block their rows by the batch's row count, which reorders fp32 sums:
            # a few ulp of the largest element (fp32 ulp is 1.2e-7 relative), so 1e-6 relative to it.
            assert float((alone - span).abs().max()) <= 1e-6 * float(span.abs().max()), grid
            start += n
        with batch_invariant():
            batch = encoder(patches, GRIDS)
            first = encoder(patches[: GRIDS[0][0] * GRIDS[0][1]], [GRIDS[0]])[0]
            last = encoder(patches[-GRIDS[-1][0] * GRIDS[-1][1] :], [GRIDS[-1]])[0]
    assert torch.equal(first, batch[0]) and torch.equal(last, batch[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_encoder_on_cuda_equals_the_cpu_one(tiny_model):
    """The tower's torch path on the GPU (the multimodal service's --device cuda): fp32 without TF32."""
    from tests import tolerances as tol

    torch.backends.cuda.matmul.allow_tf32 = False
    encoder = tiny_model.model.encoder
    patches = patches_for(GRIDS)
    with torch.no_grad():
        cpu = encoder(patches, GRIDS)
        gpu = [span.cpu() for span in encoder.to("cuda")(patches.cuda(), GRIDS)]
    encoder.to("cpu")
    assert max(float((a - b).abs().max()) for a, b in zip(cpu, gpu)) <= tol.VISION_ATOL
