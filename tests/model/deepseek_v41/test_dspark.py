"""The DSpark draft on the tiny preset: its tensors leave the backbone's alone, the draft's own K=V
state gives the full-sequence draft, a block sees exactly its window, and semi-AR drafting chains."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.batch_invariant import batch_invariant
from model.deepseek_v41.checkpoint import draft_specs, tensor_table, text_specs, vision_specs
from model.deepseek_v41.dspark import DraftContext
from model.deepseek_v41.init import random_checkpoint
from model.deepseek_v41.presets import TINY

# The text backbone alone: no draft, no vision tower.
NO_DRAFT = dataclasses.replace(TINY, num_nextn_predict_layers=0, vision=None)


def test_draft_tensors_come_after_every_backbone_tensor_and_leave_its_draws_alone():
    table = list(tensor_table(TINY))
    text = [s.name for s in text_specs(TINY)]
    draft = [s.name for s in draft_specs(TINY)]
    assert table[: len(text)] == text and table == list(tensor_table(NO_DRAFT)) + draft + [
        s.name for s in vision_specs(TINY)
    ]  # the vision tower after the draft
    assert draft and all(name.startswith("mtp.") for name in table[len(text) : len(text) + len(draft)])
    old, new = random_checkpoint(NO_DRAFT, 5), random_checkpoint(TINY, 5)
    assert set(old) < set(new)
    for name, value in old.items():
        assert torch.equal(value.view(torch.uint8), new[name].view(torch.uint8)), name


def test_tiny_has_three_stages_and_the_named_heads():
    names = set(tensor_table(TINY))
    assert {f"mtp.{k}.attn.wkv.weight" for k in range(3)} <= names
    assert {
        "mtp.0.main_proj.weight",
        "mtp.0.main_norm.weight",
        "mtp.2.norm.weight",
        "mtp.2.markov_head.embed.weight",
        "mtp.2.markov_head.head.weight",
        "mtp.2.confidence_head.proj.weight",
    } <= names
    assert "mtp.1.main_proj.weight" not in names and "mtp.0.norm.weight" not in names
    assert tensor_table(TINY)["mtp.1.ffn.experts.7.w1.weight"].fmt == "mxfp4"
    assert "mtp.1.ffn.experts.8.w1.weight" not in names  # the draft's own expert count


@pytest.fixture(scope="module")
def tapped(tiny_model):
    model = tiny_model.model
    ids = torch.randint(3, 120000, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, taps = model.forward_with_taps(ids)
    return model, ids, logits, taps


def test_the_text_forward_is_unchanged_by_taps(tapped):
    model, ids, logits, taps = tapped
    assert taps.shape == (2, 40, 3 * TINY.hidden_size)
    with torch.no_grad():
        assert torch.equal(model(ids), logits)


def _cached_block(model, taps, row, anchor, token, chunks):
    ctx = DraftContext.empty(model.draft, 1)
    done = 0
    for n in chunks:
        n = min(n, anchor - done)
        if n > 0:
            ctx.append(model.draft, taps[row : row + 1, done : done + n])
            done += n
    assert done == anchor and int(ctx.next_position) == anchor
    return model.draft.blocks_from_context(ctx, token.view(1), model.embed, model.head)


def test_own_context_state_equals_the_full_sequence_draft_exactly_in_batch_invariant_mode(tapped):
    model, ids, _, taps = tapped
    anchors = torch.tensor([[3, 25], [30, 40]])  # 3 < W: a partly empty window; 40: after the last position
    tokens = torch.tensor([[11, 12], [13, 14]])
    with torch.no_grad(), batch_invariant():
        full = model.draft(taps, tokens, anchors, model.embed, model.head)
        for row in range(2):
            for a in range(2):
                cached = _cached_block(model, taps, row, int(anchors[row, a]), tokens[row, a], (3, 7, 1, 100))
                assert torch.equal(cached.logits[0, 0], full.logits[row, a])
                assert torch.equal(cached.hidden[0, 0], full.hidden[row, a])
                for stage in range(3):
                    assert torch.equal(cached.streams[stage][0, 0], full.streams[stage][row, a])


def test_a_block_sees_exactly_its_context_window(tapped):
    model, _, _, taps = tapped
    taps = taps[:1]
    anchor, w = 30, TINY.sliding_window
    args = (torch.tensor([[7]]), torch.tensor([[anchor]]), model.embed, model.head)
    with torch.no_grad():
        base = model.draft(taps, *args).logits
        for moved, should_change in ((anchor - w - 1, False), (anchor - w, True), (anchor - 1, True), (anchor, False)):
            poked = taps.clone()
            poked[:, moved] += 1.0
            changed = not torch.equal(model.draft(poked, *args).logits, base)
            assert changed == should_change, f"position {moved}"


def test_semi_ar_drafts_chain_through_the_markov_head(tapped):
    model, _, _, taps = tapped
    tokens, anchors = torch.tensor([[5], [6]]), torch.tensor([[20], [33]])
    with torch.no_grad(), batch_invariant():  # one slot at a time vs the whole block: same per-row sums
        blocks = model.draft(taps, tokens, anchors, model.embed, model.head)
        drafts, heads = model.draft.propose(blocks, tokens, lambda logits, slot: logits.argmax(-1))
        prev = torch.cat((tokens.unsqueeze(-1), drafts[..., :-1]), dim=-1)
        forced = model.draft.heads(blocks, prev)
    assert drafts.shape == (2, 1, TINY.dspark_block_size)
    assert torch.equal(drafts, forced.logits.argmax(-1))
    assert torch.equal(heads.logits, forced.logits) and torch.equal(heads.confidence_logits, forced.confidence_logits)
    other = model.draft.heads(blocks, prev.flip(-1))
    assert not torch.equal(other.logits, forced.logits)  # the Markov bias reads prev
    conf = torch.sigmoid(heads.confidence_logits)
    assert bool(((conf > 0) & (conf < 1)).all()) and float(conf.std()) > 1e-3
