"""Full-sequence logits of our model vs NeMo AutoModel 0.7.0 on the same released-format checkpoint."""

from __future__ import annotations

import pytest
import torch

from model.deepseek_v41 import moe
from model.deepseek_v41.safetensors_io import read_checkpoint
from tests.model.deepseek_v41.oracle_configs import CASES

pytest.importorskip("nemo_automodel")

from tests.model.deepseek_v41.oracle_harness import assert_matches, run_both  # noqa: E402

CASE_NAMES = [c.name for c in CASES]


@pytest.mark.parametrize("name", CASE_NAMES)
def test_checkpoint_is_in_released_formats(oracle_cases, name):
    tensors = read_checkpoint(oracle_cases[name].path)
    dtypes = {k: v.dtype for k, v in tensors.items()}
    assert dtypes["layers.0.ffn.experts.0.w1.weight"] == torch.int8  # MXFP4, two codes per byte
    assert dtypes["layers.0.attn.wq_a.weight"] == torch.float8_e4m3fn
    assert dtypes["layers.0.attn.wq_a.scale"] == torch.float8_e8m0fnu
    engram_layer = oracle_cases[name].case.cfg.engram_layer_ids[0]
    assert dtypes[f"layers.{engram_layer}.engram.embed.weight"] == torch.float8_e4m3fn
    assert dtypes["layers.0.hc_attn_fn"] == torch.float32
    assert dtypes["embed.weight"] == torch.bfloat16


@pytest.mark.parametrize("name", CASE_NAMES)
def test_nemo_loads_strictly(oracle_cases, name):
    built = oracle_cases[name]
    assert built.nemo_missing == [] and built.nemo_unexpected == []


@pytest.mark.parametrize("name", CASE_NAMES)
def test_prompts_truncate_every_mechanism(oracle_cases, name):
    cfg, s = oracle_cases[name].case.cfg, oracle_cases[name].case.seq_len
    assert s > cfg.sliding_window
    ratios = {cfg.ratio(i) for i in range(cfg.num_hidden_layers)} - {0}
    for r in ratios:
        assert s // r > cfg.index_topk, f"top-k never truncates for ratio {r}"
    if 2 in ratios:
        assert s % 2 == 1, "an odd length leaves an incomplete ratio-2 group"
    if cfg.candidate_source_layer_id is not None:
        entries = s // cfg.ratio(cfg.candidate_source_layer_id)
        assert -(-entries // cfg.candidate_block_size) > cfg.candidate_topk_blocks


@pytest.mark.parametrize("name", CASE_NAMES)
def test_logits_match_nemo(oracle_cases, name, monkeypatch):
    built = oracle_cases[name]
    clamped = []
    original = moe.clamped_swiglu

    def spy(gate, up, limit):
        clamped.append(bool((gate > limit).any() | (up.abs() > limit).any()))
        return original(gate, up, limit)

    monkeypatch.setattr(moe, "clamped_swiglu", spy)
    ours, nemo, comparison = run_both(built.ours, built.nemo, built.ids)
    print(
        f"\n{name}: max|Δ| {comparison.max_abs_diff:.3g} (all positions {comparison.max_abs_diff_all:.3g}), "
        f"replayed flips {comparison.replayed}, other flips/near ties {len(comparison.flips)}, "
        f"exempt {comparison.exempt_fraction:.1%}, "
        f"min oracle top-k margin {comparison.min_topk_margin:.3g}, logits std {nemo.std():.3f}"
    )
    assert_matches(comparison, name)
    assert any(clamped), "the SwiGLU clamps never fired"
    assert float(nemo.std()) > 0.1, "logits are nearly constant: the random weights are too quiet"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_both_models_dequantise_to_identical_weights(oracle_cases, name):
    """NeMo's HF adapter decodes the FP8/MXFP4 bytes itself; every weight must equal ours bit for bit."""
    from model.deepseek_v41.checkpoint import tensor_table

    built = oracle_cases[name]
    theirs = built.nemo.state_dict_adapter.to_hf(built.nemo.state_dict())
    ours = dict(built.ours.named_parameters())
    table = tensor_table(built.ours.cfg)
    assert set(theirs) == set(table)
    for spec in table.values():
        mine = ours[spec.target] if spec.index is None else ours[spec.target][spec.index]
        assert torch.equal(mine.detach(), theirs[spec.name].float()), spec.name


def test_flash_tensor_table_matches_nemo_names_and_shapes():
    """The released Flash layout: NeMo built on the meta device, exported through its adapter."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    from model.deepseek_v41.checkpoint import tensor_table
    from model.deepseek_v41.config import ModelConfig, to_hf_dict
    from model.deepseek_v41.tokenizer import v41_tokenizer_path

    cfg = ModelConfig()
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
    released = nemo.state_dict_adapter.to_hf(nemo.state_dict())
    table = {name: spec for name, spec in tensor_table(cfg).items() if not name.startswith("mtp.")}
    assert len(table) == 47006 and set(released) == set(table)
    assert all(tuple(released[name].shape) == spec.shape for name, spec in table.items())


def test_flash_draft_table_matches_nemo_dspark_names_and_shapes():
    """The released ``mtp.*`` layout: NeMo's DSpark module built on the meta device, exported through its
    adapter (which also names the target's embed and head, shared with the backbone)."""
    from nemo_automodel.components.models.common import BackendConfig
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.dspark import DeepseekV41DSparkModel

    from model.deepseek_v41.checkpoint import draft_specs
    from model.deepseek_v41.config import ModelConfig, to_hf_dict

    cfg = ModelConfig()
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
        text = DeepseekV41Config(**to_hf_dict(cfg)).text_config
        nemo = DeepseekV41DSparkModel(text, backend, num_anchors=1, enable_confidence_head=True)
    released = nemo.state_dict_adapter.to_hf(nemo.state_dict())
    draft = {spec.name: spec for spec in draft_specs(cfg)}
    assert set(released) - set(draft) == {"embed.weight", "head.weight"} and set(draft) <= set(released)
    assert all(tuple(released[name].shape) == spec.shape for name, spec in draft.items())
