"""services/worker/manifest_compile.py through `shinkai cache compile`: a manifest recorded by one process, its Triton
binaries then removed (a new node given the manifests), is compiled on this CPU for the sm_90 its key names, and a
later process's compiles of those variants are all Triton file-cache hits; manifests of other versions or of a CPU
device are skipped, each with its reason."""

from __future__ import annotations

import json
import os
import shutil

from services import cache_dirs
from services.worker.manifest_compile import target_of
from services.worker.manifest_key import KEY_FILE, versions
from tests.services.writer_process import json_result, module_process

VARIABLES = [c.env for c in cache_dirs.CACHES if c.env is not None]


def _key(device: str, capability: list[int] | None = None, **other: str) -> str:
    valid: dict[str, object] = {**versions(), "device": device, **other}
    if capability is not None:
        valid["capability"] = capability
    return json.dumps({"picks": {}, "valid": valid})


def test_a_seeded_root_compiled_without_a_gpu_gives_file_cache_hits(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env["SHINKAI_CACHE_DIR"] = str(tmp_path)
    first = json_result(module_process(env, "tests.services.worker.manifest_writer", "--blocks", "64,128"))
    assert first["misses"] == 2  # recorded into variants/test
    variants = tmp_path / "variants"
    (variants / "test" / KEY_FILE).write_text(_key("cuda:0", [9, 0]))
    (variants / "old").mkdir()
    (variants / "old" / KEY_FILE).write_text(_key("cuda", [9, 0], triton="0.0.1"))
    (variants / "cpu").mkdir()
    (variants / "cpu" / KEY_FILE).write_text(_key("cpu"))
    shutil.rmtree(tmp_path / "triton")  # the binaries gone, the manifests kept

    compiled = module_process(env, "services.entrypoints.cli", "cache", "compile", "--processes", "2")
    out, err = compiled.communicate(timeout=300)
    assert compiled.returncode == 0, err
    lines = out.splitlines()
    assert "compiled test for cuda sm_90: 2 of 2 variants (0 failed)" in " ".join(lines), out
    assert "skipped old: other versions (triton 0.0.1)" in lines
    assert "skipped cpu: not a CUDA device's" in lines

    second = json_result(module_process(env, "tests.services.worker.manifest_writer", "--blocks", "64,128"))
    assert second["hits"] == 2 and second["misses"] == 0


def test_the_target_is_the_keys_cuda_capability():
    assert target_of(json.loads(_key("cuda:1", [9, 0]))) == ("cuda", 90, 32)
    assert target_of(json.loads(_key("cuda", [10, 0]))) == ("cuda", 100, 32)
    assert target_of(json.loads(_key("cpu"))) is None
    assert target_of(json.loads(_key("cuda"))) is None  # no capability recorded (no GPU when it was written)
    assert target_of({}) is None


def test_a_bad_process_count_is_a_usage_error(tmp_path, monkeypatch, capsys):
    from services.entrypoints.cli import main

    monkeypatch.setenv("SHINKAI_CACHE_DIR", str(tmp_path))
    assert main(["cache", "compile", "--processes", "0"]) == 2
    assert "--processes is at least 1" in capsys.readouterr().err
