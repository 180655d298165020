"""`shinkai cache`, `shinkai cache clear` and `shinkai cache prune` on a private cache root."""

from __future__ import annotations

import io
import json

import pytest

from services.cache_dirs import CACHES
from services.entrypoints.cli import main


@pytest.fixture
def root(tmp_path, monkeypatch):
    monkeypatch.setenv("SHINKAI_CACHE_DIR", str(tmp_path))
    for c in CACHES:
        if c.env is not None:
            monkeypatch.setenv(c.env, "")  # unset for the command, restored afterwards
    (tmp_path / "triton" / "A").mkdir(parents=True)
    (tmp_path / "triton" / "A" / "k.cubin").write_bytes(b"x" * 2048)
    (tmp_path / "tokenizer" / "abc").mkdir(parents=True)
    (tmp_path / "tokenizer" / "abc" / "tokenizer.json").write_text("{}")
    return tmp_path


def _lines(capsys) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:]}


@pytest.mark.parametrize("argv", [["cache"], ["cache", "show"]])
def test_show_lists_each_cache_with_its_entries_size_and_directory(root, capsys, argv):
    assert main(argv) == 0
    rows = _lines(capsys)
    assert set(rows) == {c.name for c in CACHES}
    assert rows["triton"][1:] == ["1", "2.0", "KiB", str(root / "triton")]
    assert rows["inductor"][1:] == ["0", "0", "B", str(root / "inductor")]


def test_clear_needs_confirmation_and_empties_only_what_is_named(root, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO(""))  # not a terminal: no question, an error
    assert main(["cache", "clear", "--triton"]) == 2
    assert "pass --yes" in capsys.readouterr().err
    assert (root / "triton" / "A").exists()
    assert main(["cache", "clear", "--triton", "--yes"]) == 0
    assert "cleared triton: 1 entries" in capsys.readouterr().out
    assert not any((root / "triton").iterdir())
    assert (root / "tokenizer" / "abc").exists()
    assert main(["cache", "clear", "-y"]) == 0  # every cache
    assert not any((root / "tokenizer").iterdir())


def test_prune_lists_and_removes_only_the_manifests_no_start_can_load(root, capsys):
    from services.worker.compile_manifest import CompileManifest
    from services.worker.manifest_key import KEY_FILE, describe_key

    current = CompileManifest.described_under_root({"model": "a"}, "cpu")
    current.add("kernels.rmsnorm", "_rmsnorm_kernel", "{}", "k")  # its parameters differ: a stale entry
    other = root / "variants" / "other"
    other.mkdir()
    old = json.loads(describe_key({"model": "b"}, "cpu"))
    (other / KEY_FILE).write_text(json.dumps({**old, "valid": {**old["valid"], "torch": "2.0.0"}}))
    assert main(["cache", "prune", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would remove other " in out and "(built for triton" in out and "torch 2.0.0)" in out
    assert f"would remove {current.directory.name}/" in out and "would remove 2 item(s)" in out
    assert other.exists() and len(current.entries()) == 1
    assert main(["cache", "prune"]) == 0
    assert "removed 2 item(s)" in capsys.readouterr().out
    assert not other.exists() and current.entries() == [] and (current.directory / KEY_FILE).exists()
    assert main(["cache", "prune", "--older-than", "-1"]) == 2
    assert "--older-than is a number of days" in capsys.readouterr().err
    assert main(["cache", "prune", "--older-than", "0"]) == 0  # every manifest is older than 0 days
    assert "removed 1 item(s)" in capsys.readouterr().out and not current.directory.exists()
