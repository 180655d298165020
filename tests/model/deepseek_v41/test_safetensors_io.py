"""Safetensors reading and writing: round trips, sharding, and clear errors for broken checkpoints."""

import json

import pytest
import torch

from model.deepseek_v41 import safetensors_io as io
from model.deepseek_v41.safetensors_io import CheckpointError


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(8, 16, generator=g).to(torch.float8_e4m3fn),
        "a.scale": torch.tensor([[127, 120]], dtype=torch.uint8).view(torch.float8_e8m0fnu),
        "b.weight": torch.randint(-128, 127, (4, 8), generator=g, dtype=torch.int8),
        "c": torch.randn(3, generator=g),
        "d": torch.randn(5, generator=g).to(torch.bfloat16),
    }


def _assert_same(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


def test_single_file_round_trip_keeps_dtypes(tmp_path):
    want = _tensors()
    [path] = io.write_checkpoint(want, tmp_path)
    assert path == tmp_path / "model.safetensors"
    _assert_same(io.read_checkpoint(tmp_path), want)
    _assert_same(io.read_checkpoint(path), want)
    assert io.read_metadata(path) == {"format": "pt"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temp files left


def test_views_and_shared_storage_are_written(tmp_path):
    base = torch.arange(12.0).reshape(3, 4)
    want = {"t": base.t(), "row": base[1], "base": base}
    io.write_safetensors(want, tmp_path / "x.safetensors")
    got = io.read_safetensors(tmp_path / "x.safetensors")
    for k in want:
        assert torch.equal(got[k], want[k]), k


def test_sharded_round_trip(tmp_path):
    want = _tensors()
    written = io.write_checkpoint(want, tmp_path, max_shard_bytes=100)
    shards = [p for p in written if p.name.endswith(".safetensors")]
    assert len(shards) >= 2 and written[-1].name == "model.safetensors.index.json"
    index = json.loads(written[-1].read_text())
    assert set(index["weight_map"]) == set(want)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in want.values())
    _assert_same(io.read_checkpoint(tmp_path), want)
    assert set(io.checkpoint_files(tmp_path).values()) == set(shards)


@pytest.mark.parametrize("cut", [0, 5, 8, 40, -1, -17])
def test_truncated_file_names_the_file(tmp_path, cut):
    [path] = io.write_checkpoint(_tensors(), tmp_path)
    data = path.read_bytes()
    path.write_bytes(data[:cut] if cut >= 0 else data[:cut])
    with pytest.raises(CheckpointError) as info:
        io.read_checkpoint(tmp_path)
    message = str(info.value)
    assert str(path) in message
    assert any(w in message for w in ("truncated", "too short", "does not match its header")), message


def test_trailing_bytes_are_rejected(tmp_path):
    [path] = io.write_checkpoint(_tensors(), tmp_path)
    path.write_bytes(path.read_bytes() + b"\0" * 8)
    with pytest.raises(CheckpointError, match="does not match its header"):
        io.read_checkpoint(tmp_path)


def test_corrupt_header_bytes(tmp_path):
    [path] = io.write_checkpoint(_tensors(), tmp_path)
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + header_len].decode()
    for i, (old, new) in enumerate([('"dtype"', '"dtypx"'), ('{"', '["'), ('"shape":[8,16]', '"shape":[8,17]')]):
        assert old in header
        broken = header.replace(old, new, 1).encode()
        bad = tmp_path / f"bad{i}.safetensors"
        bad.write_bytes(bytes(data[:8]) + broken + bytes(data[8 + header_len :]))
        with pytest.raises(CheckpointError, match="corrupt header") as info:
            io.read_safetensors(bad)
        assert str(bad) in str(info.value)
    # A header length far beyond the file.
    bad = tmp_path / "huge.safetensors"
    bad.write_bytes((10**12).to_bytes(8, "little") + bytes(data[8:]))
    with pytest.raises(CheckpointError, match="header length"):
        io.read_safetensors(bad)
    assert issubclass(CheckpointError, ValueError)


def test_directory_without_a_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="neither model.safetensors nor model.safetensors.index.json") as info:
        io.read_checkpoint(tmp_path)
    assert str(tmp_path) in str(info.value)
    with pytest.raises(CheckpointError, match="no such file"):
        io.read_checkpoint(tmp_path / "missing")


def _sharded(tmp_path) -> tuple[dict, dict]:
    io.write_checkpoint(_tensors(), tmp_path, max_shard_bytes=100)
    index_path = tmp_path / "model.safetensors.index.json"
    return json.loads(index_path.read_text()), _tensors()


def _rewrite_index(tmp_path, index: dict) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_index_with_a_missing_shard(tmp_path):
    index, _ = _sharded(tmp_path)
    shard = index["weight_map"]["c"]
    (tmp_path / shard).unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard} is missing"):
        io.read_checkpoint(tmp_path)


def test_index_naming_an_absent_tensor(tmp_path):
    index, _ = _sharded(tmp_path)
    index["weight_map"]["ghost.weight"] = index["weight_map"]["c"]
    _rewrite_index(tmp_path, index)
    with pytest.raises(CheckpointError, match="'ghost.weight' is missing from shard"):
        io.read_checkpoint(tmp_path)


def test_shard_holding_a_tensor_the_index_does_not_assign(tmp_path):
    index, _ = _sharded(tmp_path)
    del index["weight_map"]["c"]
    _rewrite_index(tmp_path, index)
    with pytest.raises(CheckpointError, match="'c' is not assigned to this shard"):
        io.read_checkpoint(tmp_path)


@pytest.mark.parametrize("text", ["{not json", "[]", '{"weight_map": {}}', '{"weight_map": {"c": "../x.safetensors"}}'])
def test_bad_index_documents(tmp_path, text):
    _sharded(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError, match="model.safetensors.index.json"):
        io.read_checkpoint(tmp_path)


def test_selected_names(tmp_path):
    [path] = io.write_checkpoint(_tensors(), tmp_path)
    assert set(io.read_safetensors(path, ["c", "d"])) == {"c", "d"}
    with pytest.raises(CheckpointError, match="missing tensor"):
        io.read_safetensors(path, ["c", "nope"])
    assert sorted(io.tensor_names(path)) == sorted(_tensors())
