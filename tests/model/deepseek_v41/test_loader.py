"""Loading released-format checkpoints: strict names/shapes/dtypes, dequantisation, kept quantised bytes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from model.deepseek_v41.checkpoint import stored_table, tensor_table
from model.deepseek_v41.loader import load_checkpoint
from model.deepseek_v41.quant import dequantize_weight
from model.deepseek_v41.safetensors_io import CheckpointError, read_checkpoint, write_checkpoint
from tests.model.deepseek_v41.oracle_configs import NOCAND, finish
from tests.model.deepseek_v41.oracle_harness import toy_tokenizer


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.tokenizer import engram_token_map

    tok = toy_tokenizer(NOCAND.vocab_size)
    cfg = finish(NOCAND, engram_token_map(tok)[1])
    return write_random_checkpoint(tmp_path_factory.mktemp("loader") / "ckpt", cfg, 3, tok)


def _variant(src, dst, edit):
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    tensors = read_checkpoint(src)
    edit(tensors)
    write_checkpoint(tensors, dst)
    return dst


def test_loads_and_dequantises_every_quantised_tensor(small_checkpoint):
    loaded = load_checkpoint(small_checkpoint)
    params = dict(loaded.model.named_parameters())
    table = tensor_table(loaded.config)
    quantised = [s for s in table.values() if s.fmt in ("fp8_block", "fp8_rowwise", "mxfp4")]
    assert set(loaded.quantized) == {s.name for s in quantised}
    for spec in quantised:
        weight, scale = loaded.quantized[spec.name]
        assert weight.dtype in (torch.float8_e4m3fn, torch.int8) and scale.dtype == torch.float8_e8m0fnu
        value = dequantize_weight(weight, scale, rowwise=spec.fmt == "fp8_rowwise")
        target = params[spec.target] if spec.index is None else params[spec.target][spec.index]
        assert torch.equal(target.detach(), value), spec.name
    assert params["layers.0.hc_attn.fn"].dtype == torch.float32


def test_every_stored_tensor_is_in_the_table(small_checkpoint):
    loaded = load_checkpoint(small_checkpoint)
    stored = read_checkpoint(small_checkpoint)
    table = stored_table(loaded.config)
    assert set(stored) == set(table)
    assert all(tuple(stored[k].shape) == table[k][0] and stored[k].dtype == table[k][1] for k in table)


@pytest.mark.parametrize(
    "name", ["layers.3.attn.compressor.wgate.weight", "layers.1.ffn.experts.5.w2.scale", "head.weight"]
)
def test_missing_tensor_is_named(small_checkpoint, tmp_path, name):
    path = _variant(small_checkpoint, tmp_path / "v", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"missing .*{name}"):
        load_checkpoint(path)


def test_extra_tensor_is_named(small_checkpoint, tmp_path):
    path = _variant(
        small_checkpoint,
        tmp_path / "v",
        lambda t: t.update({"layers.2.attn.compressor.wgate.weight": torch.zeros(64, 64)}),
    )
    with pytest.raises(CheckpointError, match=r"unexpected .*layers\.2\.attn\.compressor\.wgate\.weight"):
        load_checkpoint(path)


def test_misshaped_tensor_is_named(small_checkpoint, tmp_path):
    def edit(t):
        t["layers.4.attn.wo_b.weight"] = t["layers.4.attn.wo_b.weight"][:, :16].contiguous()

    path = _variant(small_checkpoint, tmp_path / "v", edit)
    with pytest.raises(
        CheckpointError, match=r"layers\.4\.attn\.wo_b\.weight has shape \[64, 16\], expected \[64, 32\]"
    ):
        load_checkpoint(path)


def test_wrong_dtype_is_named(small_checkpoint, tmp_path):
    def edit(t):
        t["layers.0.ffn.experts.0.w1.weight"] = t["layers.0.ffn.experts.0.w1.weight"].view(torch.uint8)

    path = _variant(small_checkpoint, tmp_path / "v", edit)
    with pytest.raises(CheckpointError, match=r"layers\.0\.ffn\.experts\.0\.w1\.weight has dtype torch\.uint8"):
        load_checkpoint(path)


def test_truncated_file_is_a_clear_error(small_checkpoint, tmp_path):
    dst = tmp_path / "v"
    shutil.copytree(small_checkpoint, dst)
    data = (dst / "model.safetensors").read_bytes()
    (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_checkpoint(dst)


def test_config_that_disagrees_with_the_tensors_is_caught(small_checkpoint, tmp_path):
    dst = tmp_path / "v"
    shutil.copytree(small_checkpoint, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = 64
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="expected"):
        load_checkpoint(dst)


def test_engram_size_must_match_the_tokenizer(small_checkpoint, tmp_path):
    dst = tmp_path / "v"
    shutil.copytree(small_checkpoint, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"]["engram_compressed_vocab_size"] += 1
    (dst / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="engram_compressed_vocab_size"):
        load_checkpoint(dst)
