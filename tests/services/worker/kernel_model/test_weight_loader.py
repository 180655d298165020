"""The GPU loader on CPU: a sharded `model init` checkpoint loads into the same device form (bytes and
layout) as the random build from the same seed; every kind of damage fails before tensor data is used,
with an error naming the file (and the tensor where one is known); `shinkai up` exits non-zero on it
and leaves no process behind."""

import json
import os
import shutil
import struct

import pytest
import torch

from model.deepseek_v41.config import load_config
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.safetensors_io import INDEX_FILE, CheckpointError, read_safetensors, write_safetensors
from model.deepseek_v41.tokenizer import engram_token_map, load_v41_tokenizer
from services.entrypoints.cli import main
from services.worker.kernel_model import weight_loader
from services.worker.kernel_model.gpu_model import _draw, build_kernel_model
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.weight_loader import CheckpointReader, check_checkpoint, load_kernel_model

SEED = 7


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    """`shinkai model init --preset tiny --num-layers 8`: the sharded released layout at tiny's full depth."""
    out = tmp_path_factory.mktemp("sharded") / "tiny"
    assert (
        main(
            [
                "model",
                "init",
                "--preset",
                "tiny",
                "--num-layers",
                "8",
                "--out",
                str(out),
                "--seed",
                str(SEED),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    return out


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items()}


def test_sharded_init_writes_one_part_per_shard_with_an_index(sharded):
    index = json.loads((sharded / INDEX_FILE).read_text())
    shards = sorted(p.name for p in sharded.glob("model-*.safetensors"))
    # embed/norm/head, 8 layers, the draft, the vision tower last
    assert shards == [f"model-{i:05d}-of-00011.safetensors" for i in range(1, 12)]
    assert index["weight_map"]["mtp.0.main_proj.weight"] == "model-00010-of-00011.safetensors"
    assert set(index["weight_map"].values()) == set(shards)
    assert index["weight_map"]["layers.3.attn.wq_a.weight"] == "model-00005-of-00011.safetensors"
    assert (
        index["weight_map"]["image_newline"]
        == index["weight_map"]["vision.norm.weight"]
        == "model-00011-of-00011.safetensors"
    )
    assert load_config(sharded) == TINY


def test_device_form_equals_the_random_build(sharded):
    """The loader and the random v41-s1 build (same seed, as build_random_kernel_model draws it) give the
    same converted modules, byte for byte: same names, dtypes, shapes and bytes of every parameter and
    buffer."""
    kernels = KernelSet.references()
    loaded, _, report = load_kernel_model(sharded, "cpu", "fp8", kernels)
    tm, nc = engram_token_map(load_v41_tokenizer())
    conversions = []
    built = build_kernel_model(
        TINY,
        lambda prefix: _draw(TINY, SEED, torch.device("cpu"), prefix, False),
        "cpu",
        "fp8",
        torch.as_tensor(tm),
        nc,
        kernels,
        on_part=lambda _, done: conversions.append(done),
    )
    a, b = _state(loaded), _state(built)
    assert list(a) == list(b)
    assert any(".moe." in k or "ffn." in k for k in a) and any("weight_fp8" in k for k in a)
    for name in a:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert torch.equal(
            a[name].view(torch.uint8) if a[name].dtype.is_floating_point else a[name],
            b[name].view(torch.uint8) if b[name].dtype.is_floating_point else b[name],
        ), name
    assert type(loaded.layers[2].ffn).__name__ == "KernelMoE"
    assert report.num_parts == 3 + TINY.num_hidden_layers + 1 + 3  # + the draft, vision., aligner., image_
    assert any(k.startswith("encoder.vision.blocks.") for k in a)
    assert report.num_bytes == sum(p.stat().st_size for p in sharded.glob("model-*.safetensors")) - sum(
        8 + struct.unpack("<Q", p.read_bytes()[:8])[0] for p in sharded.glob("model-*.safetensors")
    )
    assert report.gb_per_s > 0 and report.peak_device_bytes is None
    # The conversions' own count of FP8 elements rounded at 128×128, summed over the layers.
    assert report.num_inexact == sum(c.inexact for c in conversions if c is not None)
    assert sum(c is not None for c in conversions) == TINY.num_hidden_layers


def test_large_tensors_are_copied_in_bands(sharded, monkeypatch):
    """A tensor above BAND_BYTES arrives band by band with the same bytes as a whole read."""
    reader = CheckpointReader(sharded, TINY)
    whole = reader.read("layers.1.", "cpu")
    monkeypatch.setattr(weight_loader, "BAND_BYTES", 1000)  # rows of 32 B: 31 per band
    banded = reader.read("layers.1.", "cpu")
    assert set(whole) == set(banded)
    name = "layers.1.engram.embed.weight"
    assert whole[name].shape == (240, 32)  # 8 bands, the last one partial
    assert all(torch.equal(whole[k].view(torch.uint8), banded[k].view(torch.uint8)) for k in whole)


# ---------------------------------------------------------------- damage

SHARD = "model-00004-of-00011.safetensors"  # layers.2


def _copy(src, dst):
    dst.mkdir()
    for p in src.iterdir():
        os.link(p, dst / p.name)  # hard links: the damaged file is rewritten, never edited in place
    return dst


def _rewrite_header(path, edit):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    path.unlink()
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def _retensor(path, name, value):
    tensors = read_safetensors(path)
    tensors[name] = value
    path.unlink()
    write_safetensors(tensors, path)


def _bad_header(d):
    raw = (d / SHARD).read_bytes()
    (d / SHARD).unlink()
    (d / SHARD).write_bytes(struct.pack("<Q", 7) + b"{not js" + raw[8:])


def _offsets(d):
    def edit(h):
        begin, end = h["layers.2.attn.wq_b.weight"]["data_offsets"]
        h["layers.2.attn.wq_b.weight"]["data_offsets"] = [begin, end + 64]

    _rewrite_header(d / SHARD, edit)


def _truncate(d):
    raw = (d / SHARD).read_bytes()
    (d / SHARD).unlink()
    (d / SHARD).write_bytes(raw[:-100])


def _missing_shard(d):
    (d / SHARD).unlink()


def _shape(d):
    _retensor(d / SHARD, "layers.2.attn_norm.weight", torch.ones(TINY.hidden_size + 1, dtype=torch.bfloat16))


def _dtype(d):
    _retensor(d / SHARD, "layers.2.attn_norm.weight", torch.ones(TINY.hidden_size, dtype=torch.float16))


DAMAGE = {
    "bad header": (_bad_header, [SHARD, "invalid JSON"]),
    "offsets out of range": (_offsets, [SHARD, "layers.2.attn.wq_b.weight"]),
    "truncated shard": (_truncate, [SHARD, "truncated"]),
    "missing shard": (_missing_shard, [INDEX_FILE, SHARD, "missing"]),
    "wrong shape": (_shape, [SHARD, "layers.2.attn_norm.weight", "shape [65]"]),
    "wrong dtype": (_dtype, [SHARD, "layers.2.attn_norm.weight", "F16"]),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_damage_is_refused_naming_the_file_and_tensor(sharded, tmp_path, kind):
    damage, words = DAMAGE[kind]
    d = _copy(sharded, tmp_path / "damaged")
    damage(d)
    with pytest.raises(CheckpointError) as err:
        load_kernel_model(d, "cpu", "fp8", KernelSet.references())
    for word in words:
        assert word in str(err.value), (kind, str(err.value))
    with pytest.raises(CheckpointError):
        check_checkpoint(d)  # the header-only check `up` runs first


@pytest.mark.parametrize("kind", ["truncated shard", "wrong dtype"])
def test_up_on_a_damaged_checkpoint_exits_non_zero_with_nothing_left_running(sharded, tmp_path, kind, capsys):
    damage, words = DAMAGE[kind]
    d = _copy(sharded, tmp_path / "damaged")
    damage(d)
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "up",
                "--model",
                str(d),
                "--run-dir",
                str(run_dir),
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert all(word in err for word in words), err
    assert not (run_dir / "stack.json").exists()  # nothing was started, so nothing is left


def test_an_unexpected_tensor_is_named(sharded, tmp_path):
    d = _copy(sharded, tmp_path / "extra")
    _retensor(d / SHARD, "layers.2.surprise", torch.zeros(3))
    index = json.loads((d / INDEX_FILE).read_text())
    index["weight_map"]["layers.2.surprise"] = SHARD
    (d / INDEX_FILE).unlink()
    (d / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model-00004.*layers\.2\.surprise"):
        check_checkpoint(d)
    shutil.rmtree(d)


def test_engram_tables_are_read_to_the_host_and_nothing_else_is(sharded):
    """``engram_on_host``: the loader reads the Engram tables straight to the host; every other tensor goes to the
    device asked for (here ``meta``, which holds no bytes: a table sent there would not be on the host)."""
    from services.worker.kernel_model.gpu_model import is_engram_table

    reader = CheckpointReader(sharded, TINY)
    got = reader.read("layers.1.", "meta", is_engram_table)
    tables = {name for name in got if is_engram_table(name)}
    assert tables == {"layers.1.engram.embed.weight", "layers.1.engram.embed.scale"}
    assert all(got[name].device.type == "cpu" for name in tables)
    assert all(t.device.type == "meta" for name, t in got.items() if name not in tables)
    whole = reader.read("layers.1.", "cpu")
    assert all(torch.equal(got[name].view(torch.uint8), whole[name].view(torch.uint8)) for name in tables)


def test_the_random_build_draws_engram_tables_band_by_band_to_the_host(monkeypatch):
    """The dummy build with ``engram_on_host`` keeps the tables on the host, drawn a band at a time with the same
    values as the whole draw."""
    from model.deepseek_v41 import init

    whole = _draw(TINY, SEED, torch.device("cpu"), "layers.1.", False)
    monkeypatch.setattr(init, "ROWS_PER_BAND", 64)  # 240 rows: 4 bands
    banded = _draw(TINY, SEED, torch.device("cpu"), "layers.1.", True)
    assert set(whole) == set(banded)
    for name in ("layers.1.engram.embed.weight", "layers.1.engram.embed.scale"):
        assert banded[name].device.type == "cpu"
        assert torch.equal(banded[name].view(torch.uint8), whole[name].view(torch.uint8))
