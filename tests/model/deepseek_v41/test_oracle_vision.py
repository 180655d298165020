"""The vision tower, aligner and a whole prompt with one image per row vs NeMo AutoModel 0.7.0's V4.1
(``DeepseekV41VisionTransformer``/``Aligner`` and its multimodal forward), on the same checkpoint."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests import tolerances as tol
from tests.model.deepseek_v41.conftest import image_patches, image_span_kinds
from tests.model.deepseek_v41.oracle_configs import VISION_CASES

pytest.importorskip("nemo_automodel")

from tests.model.deepseek_v41.oracle_harness import assert_matches, run_both  # noqa: E402

NAMES = [c.name for c in VISION_CASES]


def test_the_cases_are_two_different_towers():
    a, b = (c.cfg.vision for c in VISION_CASES)
    assert a.patch_size != b.patch_size and a.downsample_ratio != b.downsample_ratio
    assert a.num_attention_heads != b.num_attention_heads and a.hidden_size != b.hidden_size


@pytest.mark.parametrize("name", NAMES)
def test_nemo_loads_the_tower_strictly(oracle_cases, name):
    built = oracle_cases[name]
    assert built.nemo_missing == [] and built.nemo_unexpected == []
    assert built.nemo.model.vision is not None


@pytest.mark.parametrize("name", NAMES)
def test_tower_and_aligner_match_nemo(oracle_cases, name):
    built = oracle_cases[name]
    patches = image_patches(built.case)
    with torch.no_grad():
        ours = built.ours.encoder.features(patches, built.case.grids)
        theirs, start = [], 0
        for h, w in built.case.grids:
            states = built.nemo.model.vision(patches[start : start + h * w], h, w)
            theirs.append(built.nemo.model.aligner(states, h, w))
            start += h * w
    theirs = torch.cat(theirs)
    diff = float((ours - theirs).abs().max())
    print(f"\n{name}: tower+aligner max|Δ| {diff:.3g} over {tuple(ours.shape)}, feature std {theirs.std():.3f}")
    assert ours.shape == theirs.shape
    assert float(theirs.std()) > 0.1, "features are nearly constant: the random weights are too quiet"
    assert diff <= tol.VISION_ATOL


@pytest.mark.parametrize("name", NAMES)
def test_logits_with_an_image_match_nemo(oracle_cases, name):
    built = oracle_cases[name]
    case = built.case
    patches = image_patches(case)
    kinds = torch.full(built.ids.shape, -1, dtype=torch.long)  # NeMo's vision_token_types: -1 text
    for row, span in enumerate(image_span_kinds(case)):
        kinds[row, case.image_at : case.image_at + len(span)] = torch.tensor(span)
    with torch.no_grad():
        rows = torch.cat(built.ours.encoder(patches, case.grids))
    nemo_kwargs = dict(pixel_values=patches, image_grid_hws=torch.tensor(case.grids), vision_token_types=kinds)
    ours, nemo, comparison = run_both(built.ours, built.nemo, built.ids, {"image_rows": rows}, nemo_kwargs)
    text_only, _, _ = run_both(built.ours, built.nemo, built.ids, {"image_rows": torch.zeros_like(rows)}, nemo_kwargs)
    print(
        f"\n{name}: max|Δ| {comparison.max_abs_diff:.3g} (all positions {comparison.max_abs_diff_all:.3g}), "
        f"replayed flips {comparison.replayed}, other flips/near ties {len(comparison.flips)}, "
        f"exempt {comparison.exempt_fraction:.1%}, logits std {nemo.std():.3f}"
    )
    assert_matches(comparison, name)
    assert float((text_only - ours)[:, case.image_at :].abs().max()) > 1e-2, "the image does not move the logits"


def test_flash_vision_tensors_match_nemo_names_and_shapes():
    """The released Flash tower (32 blocks of 1024, into D = 5120): NeMo on the meta device, through its adapter."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from model.deepseek_v41.checkpoint import vision_specs
    from model.deepseek_v41.config import ModelConfig, to_hf_dict
    from model.deepseek_v41.init import first_layers
    from model.deepseek_v41.tokenizer import v41_tokenizer_path
    from model.deepseek_v41.vision_config import VisionConfig

    cfg = first_layers(dataclasses.replace(ModelConfig(), vision=VisionConfig()), 1)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_file(str(v41_tokenizer_path())))
    backend = BackendConfig(
        attn="eager",
        linear="torch",
        rms_norm="torch_fp32",
        rope="torch",
        experts="torch",
        dispatcher="torch",
        enable_hf_state_dict_adapter=True,
        gate_precision="float32",
    )
    with torch.device("meta"):
        nemo = DeepseekV41ForCausalLM(DeepseekV41Config(**to_hf_dict(cfg)), backend=backend, tokenizer=tokenizer)
    released = {
        k: v
        for k, v in nemo.state_dict_adapter.to_hf(nemo.state_dict()).items()
        if k.startswith(("vision.", "aligner.", "image_"))
    }
    specs = {s.name: s for s in vision_specs(cfg)}
    assert len(specs) == 2 + 32 * 8 + 1 + 4 + 3 and set(released) == set(specs)
    assert all(tuple(released[name].shape) == spec.shape for name, spec in specs.items())
