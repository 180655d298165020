"""Switch off one mechanism at a time, in both models: the logits must move, and still match NeMo.

This shows the oracle configs really exercise each mechanism (a dead mechanism would not move the
logits, and a mechanism both models got wrong in the same way would still be caught elsewhere).
Variants edit the SAME released-format checkpoint: either its config.json or some tensors.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model.deepseek_v41.loader import load_checkpoint
from model.deepseek_v41.safetensors_io import read_checkpoint, write_checkpoint
from tests import tolerances as tol

pytest.importorskip("nemo_automodel")

from tests.model.deepseek_v41.oracle_harness import assert_matches, nemo_model, run_both  # noqa: E402


def _config_edit(**text_fields):
    def edit(config: dict, tensors: dict[str, torch.Tensor]) -> None:
        config["text_config"].update(text_fields)

    return edit


def _tensor_edit(pattern: str, value: float):
    def edit(config: dict, tensors: dict[str, torch.Tensor]) -> None:
        hits = [k for k in tensors if pattern in k and not k.endswith(".scale")]
        assert hits, f"no tensor matches {pattern!r}"
        for k in hits:
            tensors[k] = torch.full_like(tensors[k].float(), value).to(tensors[k].dtype)

    return edit


# mechanism → (oracle case, edit). Each one removes or neutralises exactly one mechanism.
VARIANTS = {
    "engram": ("oracle", _tensor_edit(".engram.wkv.weight", 0.0)),
    "attention sink": ("oracle", _tensor_edit(".attn.attn_sink", -1e9)),
    "sliding window width": ("oracle", _config_edit(sliding_window=3)),
    "ratio-1 reuse layer 6 → ratio 0": ("oracle", _config_edit(compress_ratios=[0, 0, 2, 2, 2, 1, 0, 1, 0])),
    "ratio-2 reuse layer 3 → ratio 0": ("oracle", _config_edit(compress_ratios=[0, 0, 2, 0, 2, 1, 1, 1, 0])),
    "candidate blocks": ("oracle", _config_edit(candidate_source_layer_id=-1)),
    "index top-k truncation": ("nocand", _config_edit(index_topk=64)),
    "SwiGLU clamps": ("wide", _config_edit(swiglu_limit=1e4)),
    "router selection bias": ("wide", _tensor_edit(".ffn.gate.bias", 0.0)),
    "shared expert": ("wide", _tensor_edit(".ffn.shared_experts.w2.weight", 0.0)),
    "mHC dynamic mixing": ("nocand", _tensor_edit("_fn", 0.0)),
}


@pytest.mark.parametrize("mechanism", list(VARIANTS))
def test_switching_off_moves_logits_and_still_matches(oracle_cases, tmp_path, mechanism):
    case_name, edit = VARIANTS[mechanism]
    built = oracle_cases[case_name]
    variant = tmp_path / "variant"
    variant.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(built.path / name, variant / name)
    config = json.loads((built.path / "config.json").read_text())
    tensors = read_checkpoint(built.path)
    edit(config, tensors)
    (variant / "config.json").write_text(json.dumps(config))
    write_checkpoint(tensors, variant)

    ours = load_checkpoint(variant).model
    nemo, missing, unexpected = nemo_model(Path(variant))
    assert missing == [] and unexpected == []
    with torch.no_grad():
        baseline = built.ours(built.ids)
    logits, _, comparison = run_both(ours, nemo, built.ids)
    moved = float((logits - baseline).abs().max())
    print(
        f"\n{mechanism}: logits moved {moved:.3g}; vs NeMo max|Δ| {comparison.max_abs_diff:.3g}, "
        f"replayed flips {comparison.replayed}, other flips/near ties {len(comparison.flips)}, "
        f"exempt {comparison.exempt_fraction:.1%}"
    )
    assert moved >= tol.SENSITIVITY_MIN_MOVE, f"switching off {mechanism} did not move the logits ({moved:.3g})"
    assert_matches(comparison, f"{case_name} without {mechanism}")
