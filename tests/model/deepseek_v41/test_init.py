"""``shinkai model init``: the files, the presets, determinism and the refusals (disk, depth)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from model.deepseek_v41.checkpoint import stored_bytes, tensor_table
from model.deepseek_v41.config import ModelConfig, load_config
from model.deepseek_v41.init import random_checkpoint, random_value
from model.deepseek_v41.presets import TINY, V41_S1, V41_S1_DSPARK
from model.deepseek_v41.tokenizer import load_tokenizer
from services.entrypoints.cli import main


def test_tiny_writes_config_tokenizer_and_released_formats(tiny_checkpoint):
    names = {p.name for p in tiny_checkpoint.iterdir()}
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"} <= names
    cfg = load_config(tiny_checkpoint)
    assert cfg == TINY
    assert json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]["vocab_size"] == 129280
    tok = load_tokenizer(tiny_checkpoint)
    assert tok.get_vocab_size(with_added_tokens=True) == 129280
    assert tok.id_to_token(128799) == "<｜System｜>"


def test_tiny_loads_and_runs(tiny_model):
    ids = torch.tensor([[0, 128799, 19923, 128803, 1]])
    with torch.no_grad():
        logits = tiny_model.model(ids)
    assert logits.shape == (1, 5, 129280) and bool(torch.isfinite(logits).all())


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = random_checkpoint(TINY, 1)
    b = random_checkpoint(TINY, 1)
    c = random_checkpoint(TINY, 2)
    assert all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)) for k in a)
    assert not torch.equal(a["layers.0.attn.wq_a.weight"].float(), c["layers.0.attn.wq_a.weight"].float())


def test_random_weights_are_loud_not_the_std_002_init():
    g = torch.Generator().manual_seed(0)
    table = tensor_table(TINY)
    assert float(random_value(table["layers.2.hc_attn_base"], g).std()) > 0.2
    sink = table["layers.2.attn.attn_sink"]
    assert torch.equal(
        random_value(sink, torch.Generator().manual_seed(3)),
        torch.randn(sink.shape, generator=torch.Generator().manual_seed(3)),
    )  # unit variance
    wq = random_value(table["layers.2.attn.wq_a.weight"], g)
    assert abs(float(wq.std()) - TINY.hidden_size**-0.5) < 0.02
    norm = random_value(table["layers.2.attn_norm.weight"], g)
    assert abs(float(norm.mean()) - 1) < 0.1 and float(norm.std()) > 0.1


def test_v41_s1_larger_than_the_free_disk_is_refused_with_the_reason(tmp_path, capsys, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(100e9, 90e9, 10e9))
    assert main(["model", "init", "--preset", "v41-s1", "--out", str(tmp_path / "s1")]) == 2
    err = capsys.readouterr().err
    assert "GB of weights" in err and "10.0 GB free" in err and "--num-layers" in err
    assert not (tmp_path / "s1").exists()


def test_num_layers_out_of_range_is_a_usage_error(tmp_path, capsys):
    assert main(["model", "init", "--preset", "tiny", "--num-layers", "9", "--out", str(tmp_path / "x")]) == 2
    assert "between 1 and 8" in capsys.readouterr().err


def test_v41_s1_is_flash_shaped_with_48_experts():
    assert (V41_S1.hidden_size, V41_S1.num_hidden_layers, V41_S1.n_routed_experts) == (5120, 40, 48)
    assert V41_S1.num_experts_per_tok == 6 and V41_S1.head_dim == 512
    assert 75e9 < stored_bytes(V41_S1) < 90e9


def test_unknown_preset_is_a_usage_error(tmp_path, capsys):
    assert main(["model", "init", "--preset", "huge", "--out", str(tmp_path / "x")]) == 2
    assert "unknown preset" in capsys.readouterr().err


def test_seed_changes_the_file(tmp_path):
    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.safetensors_io import read_checkpoint
    from model.deepseek_v41.tokenizer import engram_token_map
    from tests.model.deepseek_v41.oracle_configs import NOCAND, finish
    from tests.model.deepseek_v41.oracle_harness import toy_tokenizer

    tok = toy_tokenizer(256)
    cfg = finish(NOCAND, engram_token_map(tok)[1])
    digests = []
    for i, seed in enumerate((4, 4, 5)):
        # Tensor bytes, not file bytes: safetensors writes its metadata map in hash order.
        tensors = read_checkpoint(write_random_checkpoint(tmp_path / f"s{i}", cfg, seed, tok))
        h = hashlib.sha256()
        for name in sorted(tensors):
            h.update(name.encode() + tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
        digests.append(h.hexdigest())
    assert digests[0] == digests[1] != digests[2]


@pytest.mark.parametrize("cfg", [V41_S1, V41_S1_DSPARK, ModelConfig()], ids=["v41-s1", "v41-s1-dspark", "flash"])
def test_large_configs_build_on_meta_and_match_the_table(cfg):
    from model.deepseek_v41.model import DeepseekV41

    token_map = torch.zeros(cfg.vocab_size, dtype=torch.long)  # a stand-in; only shapes matter here
    with torch.device("meta"):
        model = DeepseekV41(cfg, token_map, cfg.engram_compressed_vocab_size)
    params = dict(model.named_parameters())
    table = tensor_table(cfg)
    assert set(params) == {s.target for s in table.values()}
    for s in table.values():
        shape = params[s.target].shape[1:] if s.index is not None else params[s.target].shape
        assert tuple(shape) == s.shape, s.name


def test_v41_s1_dspark_adds_a_draft_of_three_stages_and_a_few_gigabytes():
    """The speculative bench's shape: v41-s1's backbone unchanged, plus the draft with an eighth of its experts."""
    target, draft = tensor_table(V41_S1), tensor_table(V41_S1_DSPARK)
    assert {n: s.shape for n, s in target.items()} == {n: s.shape for n, s in draft.items() if not n.startswith("mtp.")}
    extra = {n: s for n, s in draft.items() if n.startswith("mtp.")}
    assert {n.split(".")[1] for n in extra if n.split(".")[1].isdigit()} == {"0", "1", "2"}
    assert 1e9 < stored_bytes(V41_S1_DSPARK) - stored_bytes(V41_S1) < 6e9  # fits beside v41-s1's ~80 GB on one H200


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


def test_device_draws_are_whole_per_name_and_band_independent(monkeypatch):
    """v41-s1's builder: every released tensor, in its format, the same whatever is asked for."""
    from model.deepseek_v41 import init
    from model.deepseek_v41.loader import check_tensors

    whole: dict[str, torch.Tensor] = {}
    for entry in init.random_stored_on_device(TINY, 3, "cpu"):
        whole.update(entry)
    check_tensors(TINY, whole)
    monkeypatch.setattr(init, "ROWS_PER_BAND", 64)  # the Engram tables (240, 306 rows) now come in bands
    layer4: dict[str, torch.Tensor] = {}
    for entry in init.random_stored_on_device(TINY, 3, "cpu", prefix="layers.4."):
        layer4.update(entry)
    assert layer4 and all(k.startswith("layers.4.") for k in layer4)
    assert any(".engram.embed." in k for k in layer4)
    assert all(torch.equal(_bytes_of(layer4[k]), _bytes_of(whole[k])) for k in layer4)
    other = next(iter(init.random_stored_on_device(TINY, 4, "cpu", prefix="layers.4.attn.wq_a")))
    assert not torch.equal(_bytes_of(other["layers.4.attn.wq_a.weight"]), _bytes_of(whole["layers.4.attn.wq_a.weight"]))
