"""`shinkai cache` and `shinkai cache clear` on a private cache root."""

from __future__ import annotations

import io

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
