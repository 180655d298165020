import copy
import json

import pytest

from model.deepseek_v41.config import ModelConfig, from_hf_dict, load_config, to_hf_dict
from model.deepseek_v41.presets import TINY

ORACLE_CONFIG = "/work/shared/reference/oracle/tiny_config.json"


def composite(**text_overrides) -> dict:
    data = to_hf_dict(TINY)
    data["text_config"].update(text_overrides)
    return data


def test_flash_defaults_match_the_spec_table():
    cfg = ModelConfig()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.head_dim) == (5120, 40, 64, 512)
    assert cfg.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20 + (0,) * 3
    assert cfg.rms_norm_eps == 1e-20 and cfg.engram_num_embeddings == (384006168, 384016682)


def test_layer_roles_follow_nearest_source_at_or_below():
    cfg = ModelConfig()
    assert [cfg.kv_source_for(i) for i in (3, 7, 9, 15, 21, 39)] == [2, 2, 8, 14, 20, 20]
    assert cfg.index_source_for(27) == 24 and cfg.kv_source_for(27) == 20
    assert cfg.kv_source_for(0) is None
    assert [i for i in range(40) if cfg.uses_candidates(i)] == [24, 28, 32, 36]


def test_reads_composite_config_with_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(TINY)))
    cfg = load_config(tmp_path)
    assert cfg == TINY
    assert from_hf_dict(to_hf_dict(cfg)) == cfg


def test_reads_the_oracle_scripts_config(tmp_path):
    data = json.loads(open(ORACLE_CONFIG).read())
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        from_hf_dict(data)  # the script fills it in from its tokenizer
    data["text_config"]["engram_compressed_vocab_size"] = 242
    (tmp_path / "config.json").write_text(json.dumps(data))
    cfg = load_config(tmp_path)
    assert cfg.vocab_size == 256 and cfg.compress_ratios[:8] == (0, 0, 2, 2, 2, 1, 1, 1)
    assert cfg.candidate_source_layer_id == 5 and cfg.engram_pad_token_id == 2


@pytest.mark.parametrize("key", ["engram_pad_token_id", "engram_pad_id"])
def test_accepts_both_spellings_of_the_engram_pad_key(key):
    data = composite()
    del data["text_config"]["engram_pad_token_id"]
    data["text_config"][key] = 7
    assert from_hf_dict(data).engram_pad_token_id == 7


def test_conflicting_engram_pad_keys_are_rejected():
    with pytest.raises(ValueError, match="conflicting Engram pad keys"):
        from_hf_dict(composite(engram_pad_token_id=2, engram_pad_id=3))


def test_candidate_source_minus_one_means_disabled():
    assert from_hf_dict(composite(candidate_source_layer_id=-1)).candidate_source_layer_id is None


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_key_value_heads", 2, "num_key_value_heads"),
        ("n_shared_experts", 2, "n_shared_experts"),
        ("scoring_func", "softmax", "scoring_func"),
        ("topk_method", "greedy", "topk_method"),
        ("hidden_act", "gelu", "hidden_act"),
        ("gate_temp", 2.0, "gate_temp"),
        ("compress_ratios", [0, 0, 4, 4, 4, 1, 1, 1, 0], "only 0, 1 and 2"),
        ("rope_scaling", {"rope_type": "linear", "factor": 2}, "rope_scaling"),
        ("rope_scaling", {"rope_type": "yarn", "factor": 16, "mscale": 0.7}, "mscale"),
        ("num_experts_per_tok", 1, "num_experts_per_tok"),
        ("num_experts_per_tok", 9, "num_experts_per_tok"),
        ("candidate_source_layer_id", 4, "candidate_source_layer_id"),
        ("kv_source_layer_ids", [2, 5, 7], "no KV source may follow"),
        ("index_source_layer_ids", [2, 4, 5, 8], "index_source_layer_ids"),
        ("compress_ratios", [0, 0, 2, 2, 2, 2, 1, 1, 0], "ratio"),
        ("o_groups", 3, "o_groups"),
        ("qk_rope_head_dim", 15, "qk_rope_head_dim"),
        ("engram_max_ngram_size", 1, "engram_max_ngram_size"),
        ("engram_num_embeddings", [240], "engram_num_embeddings"),
        ("hidden_size", 0, "hidden_size"),
        ("swiglu_limit", float("inf"), "swiglu_limit"),
    ],
)
def test_unsupported_values_are_rejected_with_the_field_named(field, value, message):
    with pytest.raises(ValueError, match=message):
        from_hf_dict(composite(**{field: value}))


def test_ratio_zero_layer_cannot_be_a_source():
    data = composite(compress_ratios=[0, 0, 0, 2, 2, 1, 1, 1, 0])
    with pytest.raises(ValueError, match="layer 2 has compress ratio 0"):
        from_hf_dict(data)


def test_bad_json_and_missing_file_are_clear(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_config(tmp_path / "nowhere")


def test_unknown_fields_are_kept_for_the_round_trip():
    data = composite()
    data["text_config"]["future_field"] = 5
    data["quantization_config"] = {"weight_block_size": [32, 32]}
    out = to_hf_dict(from_hf_dict(copy.deepcopy(data)))
    assert out["text_config"]["future_field"] == 5
    assert out["quantization_config"] == {"weight_block_size": [32, 32]}
