"""services/cache_dirs.py: where each compile cache goes, what `shinkai cache` counts and clears, and two processes
filling one cache at once, then a third finding every entry there, whole."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services import cache_dirs
from tests.services.writer_process import json_result

ROOT = Path(__file__).resolve().parents[2]
VARIABLES = [c.env for c in cache_dirs.CACHES if c.env is not None]


def _environ(**values: str) -> dict[str, str]:
    return {"HOME": "/home/someone", **values}


def test_every_cache_goes_under_the_root_unless_its_variable_is_set(tmp_path):
    env = _environ(SHINKAI_CACHE_DIR=str(tmp_path), DG_JIT_CACHE_DIR="/data/dg")
    dirs = cache_dirs.setup(env)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "triton") == str(dirs["triton"])
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert env["DG_JIT_CACHE_DIR"] == "/data/dg" == str(dirs["deepgemm"])  # the user's choice stays
    assert dirs["tokenizer"] == tmp_path / "tokenizer"
    again = dict(env)
    cache_dirs.setup(again)
    assert again == env  # a second setup (a child process of `up`) changes nothing


def test_a_relative_root_is_made_absolute_for_the_processes_started_elsewhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = _environ(SHINKAI_CACHE_DIR="rel")
    cache_dirs.setup(env)
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "rel" / "triton")


def test_the_root_follows_xdg_then_home():
    assert cache_dirs.setup(_environ(XDG_CACHE_HOME="/xdg"))["triton"] == Path("/xdg/shinkai/triton")
    home = cache_dirs.setup(_environ(XDG_CACHE_HOME=""))["triton"]
    assert home == Path.home() / ".cache" / "shinkai" / "triton"


def _fill(path: Path, entries: dict[str, bytes]) -> None:
    for name, data in entries.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)


def test_usage_counts_entries_and_bytes_and_clear_empties_only_that_cache(tmp_path):
    env = _environ(SHINKAI_CACHE_DIR=str(tmp_path))
    cache_dirs.setup(env)
    _fill(tmp_path / "triton", {"A/k.cubin": b"x" * 10, "A/__grp__k.json": b"{}", "B/k.ptx": b"y" * 5})
    _fill(tmp_path / "triton", {"tmp.pid_1_ab/k.ptx": b"z"})  # a writer's work in progress: bytes, no entry
    _fill(tmp_path / "deepgemm", {"cache/kernel.a.1/kernel.cubin": b"c" * 7, "tmp/x": b""})
    by_name = {c.name: c for c in cache_dirs.CACHES}
    triton = cache_dirs.usage(by_name["triton"], env)
    assert (triton.num_entries, triton.num_bytes) == (2, 18)
    deepgemm = cache_dirs.usage(by_name["deepgemm"], env)
    assert (deepgemm.num_entries, deepgemm.num_bytes) == (1, 7)
    assert cache_dirs.usage(by_name["inductor"], env).num_entries == 0  # never written: nothing, no error
    cleared = cache_dirs.clear(by_name["triton"], env)
    assert cleared.num_entries == 2
    assert (tmp_path / "triton").is_dir() and not any((tmp_path / "triton").iterdir())
    assert cache_dirs.usage(by_name["deepgemm"], env).num_entries == 1  # the others untouched


def test_clear_refuses_a_directory_that_is_no_cache(tmp_path):
    triton = next(c for c in cache_dirs.CACHES if c.name == "triton")
    for wrong in (str(tmp_path), str(Path.home()), "/"):
        with pytest.raises(ValueError, match="not clearing the triton cache"):
            env = {"HOME": str(Path.home()), "SHINKAI_CACHE_DIR": str(tmp_path), "TRITON_CACHE_DIR": wrong}
            cache_dirs.clear(triton, env)


def _writer(env: dict[str, str], go: Path, blocks: str, rounds: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.services.cache_writer", "--go", str(go), "--blocks", blocks]
        + ["--rounds", str(rounds)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_fill_one_cache_at_once_and_a_third_finds_every_entry_whole(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env["SHINKAI_CACHE_DIR"] = str(tmp_path / "cache")
    blocks = ",".join(str(16 << i) for i in range(8))  # 8 variants of one kernel, compiled by both at once
    go = tmp_path / "go"
    writers = [_writer(env, go, blocks, rounds=2) for _ in range(2)]
    go.touch()
    first, second = (json_result(w) for w in writers)
    triton = tmp_path / "cache" / "triton"
    assert first["triton"] == second["triton"] == str(triton)
    for r in (first, second):  # each process's second round read the first round's entries back
        assert r["hits"] + r["misses"] == 16 and r["hits"] >= 8
    # Whole files only: every group names files that exist, every file parses, no writer's temporary is left.
    entries = [d for d in triton.iterdir() if d.is_dir()]
    assert len(entries) == 8
    assert not [d for d in entries if d.name.startswith("tmp")]
    for entry in entries:
        (group,) = entry.glob("__grp__*.json")
        children = json.loads(group.read_text())["child_paths"]
        assert {Path(p).suffix for p in children.values()} >= {".json", ".ptx", ".cubin"}
        for path in map(Path, children.values()):
            data = path.read_bytes()
            assert data, path
            if path.suffix == ".json":
                json.loads(data)
            elif path.suffix == ".cubin":
                assert data[:4] == b"\x7fELF"
            elif path.suffix == ".ptx":
                assert b".version" in data and b".entry" in data
    third = json_result(_writer(env, go, blocks, rounds=1))
    assert (third["hits"], third["misses"]) == (8, 0)  # a restart compiles nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_second_engine_start_on_the_same_cache_compiles_nothing(tmp_path):
    """The served way (kernel backend, CUDA graphs) on `tiny`: a first start on an empty cache compiles, a second
    start in a new process with the same root and the same requests finds every kernel there."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env["SHINKAI_CACHE_DIR"] = str(tmp_path / "cache")

    def start() -> dict:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.services.cache_writer", "--engine", "tiny"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-3000:]
        return json.loads(out.strip().splitlines()[-1])

    cold, warm = start(), start()
    print(f"cold: {cold['misses']} compiles, {cold['hits']} hits; warm: {warm['misses']} compiles, {warm['hits']} hits")
    assert cold["misses"] > 0
    assert warm["misses"] == 0, f"compiled again: {warm['missed']}"
