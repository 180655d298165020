"""services/worker/compile_manifest.py: variants compiled for sm_90 on this CPU are recorded by two processes at
once into one manifest, each entry whole; a third process compiles the manifest at once on threads of its own beside a
stand-in for the weight load (the load waits for it to begin; the compiles end before the load does), and its
launches of those variants then compile nothing. Stale entries are skipped and counted; the key follows what it
hashes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from services import cache_dirs
from services.worker.compile_manifest import CompileManifest, stop_recording
from services.worker.manifest_key import manifest_key
from tests.services.writer_process import json_result

ROOT = Path(__file__).resolve().parents[3]
VARIABLES = [c.env for c in cache_dirs.CACHES if c.env is not None]


def _writer(env: dict[str, str], blocks: str, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.services.worker.manifest_writer", "--blocks", blocks, *extra],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_two_processes_record_at_once_and_a_third_precompiles_every_variant(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env["SHINKAI_CACHE_DIR"] = str(tmp_path / "cache")
    go = tmp_path / "go"
    writers = [_writer(env, blocks, "--go", str(go)) for blocks in ("256,512", "512,1024")]
    go.touch()
    first, second = (json_result(w) for w in writers)
    assert first["compiled"] == second["compiled"] == 2  # 512 by both at once
    directory = tmp_path / "cache" / "variants" / "test"
    files = sorted(directory.iterdir())
    assert [f.suffix for f in files] == [".json"] * 3  # one entry per variant, no writer's temporary left
    for f in files:
        entry = json.loads(f.read_text())
        data = json.loads(entry["specialization_data"])
        assert (entry["module"], entry["qualname"]) == ("kernels.rmsnorm", "_rmsnorm_kernel")
        assert data["signature"]["num_rows"] == "i32"  # do_not_specialize: its type only, never a value
    third = json_result(_writer(env, "256,512,1024", "--precompile"))
    assert third["precompiled"]["num_entries"] == third["precompiled"]["num_preloaded"] == 3
    assert third["precompiled"]["num_stale"] == 0
    # Beside the load: reported beside it, its variants read on its own threads while the load was still under way.
    during = third["during_load"]
    assert during["phase"] == "loading" and [b["phase"] for b in during["beside"]] == ["compiling"]
    assert third["by_phase"] == {"compiling": {"num_compiled": 0, "num_cached": 3, "compile_s": 0.0}}
    # The manifest's variants came from Triton's cache, and the launches found them in the kernel's table.
    assert (third["hits"], third["misses"], third["compiled"]) == (3, 0, 0)


def test_stale_entries_are_skipped_and_counted(tmp_path):
    manifest = CompileManifest(tmp_path / "m")
    data = json.dumps({"name": "kernels.rmsnorm._rmsnorm_kernel", "signature": {"x_ptr": "*fp32"}})
    manifest.add("kernels.rmsnorm", "_rmsnorm_kernel", data, "k1")  # parameters changed since
    manifest.add("kernels.gone", "_kernel", data, "k2")  # module gone
    manifest.add("kernels.rmsnorm", "_gone_kernel", data, "k3")  # kernel renamed
    (tmp_path / "m" / "tmp.123").write_text("{")  # a writer's work in progress: not an entry
    (tmp_path / "m" / "broken.json").write_text("{")  # unreadable: skipped with a warning
    (tmp_path / "m" / "list.json").write_text("[1]")  # not an entry: skipped too
    assert len(manifest.entries()) == 3
    done = manifest.precompile(workers=1)
    assert (done.num_entries, done.num_preloaded, done.num_stale) == (3, 0, 3)
    assert CompileManifest(tmp_path / "none").precompile().num_entries == 0


def test_record_writes_each_compile_and_chains_the_hook_set_before(tmp_path):
    from triton import knobs

    seen = []
    knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
    try:
        manifest = CompileManifest(tmp_path / "m")
        manifest.record()
        hook = knobs.runtime.jit_post_compile_hook

        class Info:
            module, name = "kernels.rmsnorm", "_rmsnorm_kernel"

        hook(key="k", fn=Info, compile={"key": "k", "specialization_data": "{}"})
        hook(key="k", fn=Info, compile={"key": "k", "specialization_data": "{}"})  # the same variant: one entry
        assert seen == ["k", "k"] and len(manifest.entries()) == 1
        CompileManifest(tmp_path / "n").record()  # another manifest takes over
        hook(key="j", fn=Info, compile={"key": "j", "specialization_data": "{}"})
        assert len(CompileManifest(tmp_path / "n").entries()) == 1 and len(manifest.entries()) == 1
        stop_recording()
        assert knobs.runtime.jit_post_compile_hook is not hook  # the earlier hook again
        knobs.runtime.jit_post_compile_hook(key="x")
        assert seen[-1] == "x"
    finally:
        stop_recording()
        knobs.runtime.jit_post_compile_hook = None


def test_record_again_after_another_hook_replaced_the_recording_one(tmp_path):
    """A hook set over a recording manifest's (a profiler, a test) does not stop the next ``record``: it records on
    top of that hook, which keeps being called."""
    from triton import knobs

    class Info:
        module, name = "kernels.rmsnorm", "_rmsnorm_kernel"

    seen = []
    try:
        CompileManifest(tmp_path / "first").record()
        knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["key"])
        manifest = CompileManifest(tmp_path / "second")
        manifest.record()
        knobs.runtime.jit_post_compile_hook(key="k", fn=Info, compile={"key": "k", "specialization_data": "{}"})
        assert seen == ["k"] and len(manifest.entries()) == 1
    finally:
        stop_recording()
        knobs.runtime.jit_post_compile_hook = None


def test_the_key_follows_what_picks_the_variants_and_the_versions():
    a = manifest_key({"model": {"hidden_size": 64}, "max_num_seqs": 4}, "cpu")
    assert a == manifest_key({"max_num_seqs": 4, "model": {"hidden_size": 64}}, "cpu")  # order does not matter
    assert a != manifest_key({"model": {"hidden_size": 64}, "max_num_seqs": 8}, "cpu")
    assert a != manifest_key({"model": {"hidden_size": 64}, "max_num_seqs": 4}, "cuda:1")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_a_second_start_precompiles_what_the_first_compiled_and_no_launch_compiles(tmp_path):
    """`tiny` the served way (kernel backend, CUDA graphs, the warm-up) in a fresh process twice on one empty cache
    root: the first records every variant it compiles; the second compiles the manifest at once beside its weight
    load (a probe sees both phases at once; the compiles count under ``compiling``, none compiled: Triton's cache is
    warm), before its pools, graphs and warm-up, and none of its launches (build, warm-up, requests) waits on a
    compile."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env["SHINKAI_CACHE_DIR"] = str(tmp_path / "cache")
    first = json_result(_writer(env, "", "--engine", "tiny"))
    second = json_result(_writer(env, "", "--engine", "tiny"))
    for name, start in (("first", first), ("second", second)):
        launched = start.pop("launched")
        print(f"\n{name} start: {start}; compiled for a launch: {launched}")
    assert 0 < first["entries"] <= first["launch"] + first["ahead"] and first["launch"] > 0
    # The first start had no manifest: the sampler's variants compiled in the pool's processes, none failing.
    assert any(m.startswith("precompile: the sampler's") and m.endswith(" 0 failed)") for m in first["precompiled"])
    assert second["launch"] == 0 and second["ahead"] >= first["entries"]
    # The second start's precompile ran beside its load, and its reads of Triton's cache count under compiling.
    assert ["loading", "compiling"] in second["seen"]  # the phase, then what runs beside it
    assert second["by_phase"]["compiling"]["num_cached"] >= first["entries"]
    assert all(tally["num_compiled"] == 0 for tally in second["by_phase"].values())
