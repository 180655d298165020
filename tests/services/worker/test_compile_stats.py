"""services/worker/compile_stats.py: Triton's compiles (sm_90, on the CPU: the real compiler and listener) counted
under the startup phase they happen in, and after ready; a listener set before is still called."""

from __future__ import annotations

import concurrent.futures

import triton
import triton.language as tl
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from services.worker.compile_stats import AFTER_READY, CompileStats
from services.worker.startup import StartupProgress


@triton.jit
def _kernel(x_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(x_ptr + i, tl.load(x_ptr + i) + 3)


def _compile(block: int) -> None:
    source = ASTSource(fn=_kernel, signature={"x_ptr": "*fp32", "BLOCK": "constexpr"}, constexprs={(1,): block})
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def test_compiles_are_counted_by_phase_and_after_ready(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    seen: list[bool] = []
    monkeypatch.setattr(knobs.compilation, "listener", lambda *, cache_hit, **_: seen.append(cache_hit))
    progress = StartupProgress()
    stats = CompileStats(progress)
    stats.install()
    stats.install()  # once only: the earlier listener is chained, not itself
    with progress.phase("capturing"):
        _compile(32)  # compiled
        _compile(32)  # from the cache
    progress.ready()
    _compile(64)  # a variant first needed after ready
    summary = stats.summary()
    assert set(summary) == {"capturing", AFTER_READY}
    assert (summary["capturing"]["num_compiled"], summary["capturing"]["num_cached"]) == (1, 1)
    assert summary["capturing"]["compile_s"] > 0
    assert (summary[AFTER_READY]["num_compiled"], summary[AFTER_READY]["num_cached"]) == (1, 0)
    assert seen == [False, True, False]


def test_a_compile_on_a_thread_marked_for_a_phase_beside_counts_under_that_phase(tmp_path, monkeypatch):
    """A compile manifest's pool compiling beside ``loading`` (services/engine/precompile.py)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setattr(knobs.compilation, "listener", None)
    progress = StartupProgress()
    stats = CompileStats(progress)
    stats.install()
    with progress.phase("loading"):
        with progress.beside("compiling") as step:
            with concurrent.futures.ThreadPoolExecutor(2, initializer=step.mark_thread) as pool:
                list(pool.map(_compile, (16, 128)))
        _compile(256)  # the loading thread's own
    summary = stats.summary()
    assert (summary["compiling"]["num_compiled"], summary["loading"]["num_compiled"]) == (2, 1)
