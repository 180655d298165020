"""A process that compiles variants of a project kernel for sm_90 on this CPU, recording them in a compile manifest
as an engine does (tests/services/worker/test_compile_manifest.py starts several on one cache root).

    python -m tests.services.worker.manifest_writer --blocks 64,128 [--go FILE] [--precompile]
    python -m tests.services.worker.manifest_writer --engine tiny     # an engine on CUDA, a few requests

Triton's active driver is replaced by one that targets sm_90 without a device (``Sm90Driver``): ``JITFunction``'s
own paths (``warmup``, ``preload``, the compile hooks, its in-process table) run as on a GPU, and Triton's code
generator and bundled ptxas build real cubins; nothing is launched. With ``--precompile`` the manifest is first
compiled at once as ``LLM`` does it, on threads of its own beside a stand-in for the weight load (``Preload``); then
the process waits for FILE (so writers start together), records, and compiles ``kernels.rmsnorm``'s kernel at each
``BLOCK_C`` through ``JITFunction.warmup``, the path a launch takes. It prints one JSON line: the precompile's
counts, the state the load read and the compiles by phase, how many of the launches' variants compiled (Triton's
cache-miss hook: called only for a variant the kernel's table lacks), and Triton's file-cache hits and misses. With
``--engine``
it starts an engine the served way on CUDA (it precompiles the manifest beside the load and records) and prints the
manifest's entries, how many variants compiled for a launch and ahead of any (preloaded from the manifest, or the
sampler's variants), the phases' seconds, the compiles by phase, and the phases a probe saw at once."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import threading
import time
from pathlib import Path

from services import cache_dirs

KEY = "test"
SM90 = ("cuda", 90, 32)


def sm90_driver():
    """A Triton driver for sm_90 with no device behind it (compiles only)."""
    from services.worker.compile_pool import target_driver

    return target_driver(SM90)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--blocks")
    p.add_argument("--engine", default=None, help="a model to serve on CUDA instead")
    p.add_argument("--go", type=Path)
    p.add_argument("--precompile", action="store_true")
    p.add_argument("--pool", help="blocks whose variants a compile pool compiles, read back here (_through_a_pool)")
    args = p.parse_args()
    cache_dirs.setup()
    if args.engine is not None:
        _serve_a_few(args.engine)
        return
    if args.pool is not None:
        _through_a_pool([int(b) for b in args.pool.split(",")])
        return

    import triton
    from triton import knobs

    from services.worker.compile_manifest import CompileManifest

    triton.runtime.driver.set_active(sm90_driver())
    counts = {"hits": 0, "misses": 0}

    def listener(*, cache_hit: bool, **_: object) -> None:
        counts["hits" if cache_hit else "misses"] += 1

    knobs.compilation.listener = listener
    manifest = CompileManifest.under_root(KEY)
    precompiled = _precompile_beside_a_load(manifest) if args.precompile else None
    compiled: list[str] = []

    def missed(*, repr: str, **_: object) -> None:
        compiled.append(repr)  # returns None: compile as usual

    knobs.runtime.jit_cache_hook = missed
    manifest.record()
    if args.go is not None:
        deadline = time.monotonic() + 60
        while not args.go.exists() and time.monotonic() < deadline:
            time.sleep(0.005)
    for block in (int(b) for b in args.blocks.split(",")):
        _warm_up_norm(block)
    out = {"compiled": len(compiled), **counts}
    if precompiled is not None:
        out.update(precompiled)
    print(json.dumps(out), flush=True)


def _warm_up_norm(block: int) -> None:
    """kernels/rmsnorm.py's plain launch (3 rows of 200 channels, normalised only) at ``BLOCK_C`` ``block``, compiled
    without a launch (``JITFunction.warmup``)."""
    import torch

    from kernels import rmsnorm

    x, w = torch.zeros(4, 256, dtype=torch.bfloat16), torch.ones(256)
    rmsnorm._rmsnorm_kernel.warmup(
        x, w, x, x, x, 3, 200, 256, 256, 1e-6, 0, 0, 0, 0, 0,
        ROWS=1, BLOCK_C=block, ROPE_PAIRS=0, BLOCK_P=1, BLOCK_H=1, grid=(1,),
    )  # fmt: skip


def _through_a_pool(blocks: list[int]) -> None:
    """The variants of ``_warm_up_norm`` at ``blocks`` listed (``compile_pool.listed``: nothing compiles), compiled in
    a ``CompilePool`` for sm_90, then compiled here the way a launch would: prints the entries listed, the compiles
    that failed in the pool, this process's compiles while listing, and Triton's file-cache hits and misses after."""
    import triton
    from triton import knobs

    from services.worker.compile_pool import CompilePool, listed

    triton.runtime.driver.set_active(sm90_driver())
    counts = {"hits": 0, "misses": 0}

    def listener(*, cache_hit: bool, **_: object) -> None:
        counts["hits" if cache_hit else "misses"] += 1

    knobs.compilation.listener = listener
    with listed() as entries:
        for block in blocks:
            _warm_up_norm(block)
    while_listing = dict(counts)
    pool = CompilePool(SM90, 2)
    ahead = pool.submit(entries).wait()
    pool.close()
    for block in blocks:
        _warm_up_norm(block)
    out = {"listed": len(entries), "failed": ahead.num_failed, "while_listing": while_listing, **counts}
    print(json.dumps(out), flush=True)


def _precompile_beside_a_load(manifest, timeout_s: float = 60.0) -> dict:
    """The manifest's precompile as ``LLM`` starts it (services/engine/precompile.py), beside a ``loading`` phase that
    stands for the weight load: the load waits until the precompile's phase has begun and reads the state; only then
    do the compiles begin, and the load ends only after they have. Returns the precompile's counts, the state the
    load read, and the compiles by the phase they were counted under (services/worker/compile_stats.py)."""
    from services.engine.precompile import Preload
    from services.worker import compile_manifest, startup
    from services.worker.compile_stats import STATS

    STATS.install()
    seen = threading.Event()  # the load has read the state
    original = compile_manifest.CompileManifest.precompile

    def after_the_load_looked(self, *args, **kwargs):
        if not seen.wait(timeout_s):
            raise TimeoutError("the load never began")
        return original(self, *args, **kwargs)

    compile_manifest.CompileManifest.precompile = after_the_load_looked  # type: ignore[method-assign]
    preload = Preload(manifest, "cpu").start()
    with startup.phase("loading"):
        if not preload.started.wait(timeout_s):
            raise TimeoutError("the precompile never began beside the load")
        during = startup.PROGRESS.state()
        seen.set()
        deadline = time.monotonic() + timeout_s
        while preload.result is None and time.monotonic() < deadline:  # the compiles end within the load
            time.sleep(0.01)
    done = preload.join()
    assert done is not None, "the precompile did not run to its end"
    return {
        "precompiled": dataclasses.asdict(done),
        "during_load": json.loads(during.to_json()),
        "by_phase": STATS.summary(),
    }


def _serve_a_few(model: str) -> None:
    """An engine as `shinkai up` starts one on a GPU (kernel backend, CUDA graphs, the warm-up), then prompts of a
    few lengths."""
    from triton import knobs

    from services.engine import LLM, SamplingParams
    from services.worker import compile_manifest, compile_stats, startup

    compiled = {"launch": 0, "ahead": 0}  # compiles a launch needed; compiles without a launch (preload, warmup)
    launched: list[str] = []  # the kernels of the former

    def missed(*, is_manual_warmup: bool, repr: str, **_: object) -> None:
        compiled["ahead" if is_manual_warmup else "launch"] += 1
        if not is_manual_warmup:
            launched.append(repr[:160])

    knobs.runtime.jit_cache_hook = missed
    precompiled: list[str] = []  # the engine's "precompiled N kernel variants …" and "precompile: …" lines

    class Kept(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("precompile"):  # its counts, and those of the compile pool
                precompiled.append(record.getMessage())

    engine_log = logging.getLogger("shinkai.engine")
    engine_log.setLevel(logging.INFO)
    engine_log.addHandler(Kept())
    compile_stats.install()
    states: set[tuple] = set()  # (phase, phases beside it) as a probe saw them every 2 ms
    starting = threading.Event()

    def probe() -> None:
        while not starting.wait(0.002):
            state = startup.PROGRESS.state()
            states.add((state.phase, tuple(b.phase for b in state.beside)))

    prober = threading.Thread(target=probe, daemon=True)
    prober.start()
    llm = LLM(model=model, device="cuda", max_num_seqs=4, max_model_len=256, num_blocks=64)
    starting.set()
    prompts = [[5 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate((3, 17, 40, 90))]
    llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    manifest = compile_manifest.recording()
    assert manifest is not None, "the engine's warm-up records into its compile manifest"
    out = {
        "entries": len(manifest.entries()),
        **compiled,
        "precompiled": precompiled,
        "durations": startup.PROGRESS.durations(),
        "by_phase": compile_stats.STATS.summary(),
        "seen": sorted([phase or "", *beside] for phase, beside in states),
        "launched": launched[:20],
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
