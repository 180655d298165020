"""The DSpark draft vs NeMo AutoModel 0.7.0's DSpark module on the same released-format checkpoint:
each stage's output streams, the draft logits at every block position and the confidences."""

from __future__ import annotations

import pytest
import torch

from tests import tolerances as tol
from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES, finish

pytest.importorskip("nemo_automodel")

from tests.model.deepseek_v41.dspark_oracle import (  # noqa: E402
    check_pairing,
    nemo_draft,
    nemo_taps,
    record_nemo_draft,
    run_nemo_draft,
    run_ours_draft,
)
from tests.model.deepseek_v41.oracle_harness import (  # noqa: E402
    assert_matches,
    compare,
    nemo_model,
    record_nemo,
    record_ours,
    toy_tokenizer,
)


@pytest.fixture(scope="module", params=DRAFT_CASES, ids=[c.name for c in DRAFT_CASES])
def built(request, tmp_path_factory):
    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.loader import load_checkpoint
    from model.deepseek_v41.tokenizer import engram_token_map
    from tests.model.deepseek_v41.conftest import case_ids

    case = request.param
    tok = toy_tokenizer(case.cfg.vocab_size)
    cfg = finish(case.cfg, engram_token_map(tok)[1])
    path = write_random_checkpoint(tmp_path_factory.mktemp("draft") / case.name, cfg, case.seed, tok)
    backbone, missing, unexpected = nemo_model(path)
    assert missing == [] and unexpected == []
    return case, load_checkpoint(path).model, backbone, nemo_draft(path), case_ids(case)


def test_taps_match_nemo(built):
    """Our target features against NeMo's attention-mixer inputs (backbone bin flips traced as in test_oracle)."""
    case, ours, backbone, _, ids = built
    with torch.no_grad():
        with record_nemo() as rec_nemo:
            taps_nemo = nemo_taps(backbone, ids, case.cfg.dspark_target_layer_ids)
            nemo_logits = backbone(ids).logits.float()
        rec_nemo.quant = rec_nemo.quant[: len(rec_nemo.quant) // 2]  # the two NeMo passes round identically
        rec_nemo.topk = rec_nemo.topk[: len(rec_nemo.topk) // 2]
        with record_ours(replay=rec_nemo) as rec_ours:
            logits, taps = ours.forward_with_taps(ids)
    comparison = compare(logits, nemo_logits, rec_ours, rec_nemo, ids.shape[1])
    assert_matches(comparison, case.name)
    diff = (taps - taps_nemo).abs().amax(-1)[~comparison.exempt]
    print(f"\n{case.name}: taps max|Δ| {float(diff.max()):.3g}, std {float(taps_nemo.std()):.3f}")
    assert float(diff.max()) <= tol.LOGITS_ATOL


def test_draft_matches_nemo(built):
    case, ours, backbone, draft, ids = built
    cfg, s = case.cfg, case.seq_len
    bs = cfg.dspark_block_size
    anchors = torch.tensor([[2, 20, s - 1], [cfg.sliding_window, 30, 40]])  # a partial window; the last position
    anchor_tokens = ids.gather(1, anchors)
    g = torch.Generator().manual_seed(case.seed)
    prev = torch.randint(3, cfg.vocab_size, (2, anchors.shape[1], bs), generator=g)
    prev[..., 0] = anchor_tokens
    prev = prev.flatten(1)  # [B, A·bs]: slot j's previous token (the anchor, then teacher-forced tokens)
    with torch.no_grad():
        taps = nemo_taps(backbone, ids, cfg.dspark_target_layer_ids)
        with record_nemo_draft() as rec_nemo:
            theirs = run_nemo_draft(draft, ids, taps, anchors, prev)
        blocks, heads, rec_ours = run_ours_draft(ours, taps, anchors, anchor_tokens, prev, rec_nemo)
    replayed, margin = check_pairing(rec_ours, rec_nemo)
    num_stages = cfg.num_nextn_predict_layers
    assert len(blocks.streams) == len(theirs.streams) == num_stages
    stage_diffs = [float((mine.flatten(1, 2) - nemo).abs().max()) for mine, nemo in zip(blocks.streams, theirs.streams)]
    logits_diff = float((heads.logits.flatten(1, 2) - theirs.logits).abs().max())
    conf_diff = float((heads.confidence_logits.flatten(1) - theirs.confidence_logits).abs().max())
    print(
        f"\n{case.name}: stages max|Δ| {[f'{d:.3g}' for d in stage_diffs]}, draft logits {logits_diff:.3g} "
        f"(std {float(theirs.logits.std()):.3f}), confidence logits {conf_diff:.3g}, replayed flips {replayed}, "
        f"{len(rec_nemo.quant)} roundings, min oracle top-k margin {margin:.3g}"
    )
    assert max(stage_diffs) <= tol.LOGITS_ATOL
    assert logits_diff <= tol.LOGITS_ATOL and conf_diff <= tol.LOGITS_ATOL
    assert float(theirs.logits.std()) > 0.1 and float(theirs.confidence_logits.std()) > 0.1  # loud, not uniform
    # The released model's confidence reads the pre-norm h; NeMo's trained drafts read the normed one.
    assert float((theirs.confidence_logits - theirs.confidence_logits_normed).abs().max()) > 10 * tol.LOGITS_ATOL
