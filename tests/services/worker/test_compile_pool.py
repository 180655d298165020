"""services/worker/compile_pool.py: variants listed without a compile, compiled for sm_90 in spawned processes (no
GPU, Triton's driver naming the target), are then compiled by the listing process from Triton's file cache (hits, no
miss); an entry whose kernel is gone fails in the pool and is counted, not raised."""

from __future__ import annotations

import os

from services import cache_dirs
from services.worker.compile_pool import CompilePool, entry_of, num_processes_for
from tests.services.writer_process import json_result, module_process

VARIABLES = [c.env for c in cache_dirs.CACHES if c.env is not None]


def test_variants_compiled_in_the_pool_are_cache_hits_for_the_process_that_listed_them(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env["SHINKAI_CACHE_DIR"] = str(tmp_path / "cache")
    out = json_result(module_process(env, "tests.services.worker.manifest_writer", "--pool", "64,128,256"))
    # Listing compiled nothing (no file-cache lookup at all); the pool compiled each variant; the launches' compiles
    # then read all three from Triton's file cache.
    assert out == {"listed": 3, "failed": 0, "while_listing": {"hits": 0, "misses": 0}, "hits": 3, "misses": 0}
    assert len(list((tmp_path / "cache" / "triton").iterdir())) == 3


def test_an_entry_whose_kernel_is_gone_fails_in_the_pool_and_is_counted():
    pool = CompilePool(("cuda", 90, 32), 1)
    try:
        ahead = pool.submit(
            [entry_of("kernels.rmsnorm", "no_such_kernel", "{}"), entry_of("no_such_module", "kernel", "{}")]
        ).wait()
    finally:
        pool.close()
    assert ahead.num_failed == 2 and ahead.seconds == 0
    assert "no_such_kernel" in str(ahead.futures[0].exception())


def test_one_process_per_cpu_but_one_and_none_idle():
    cpus = len(os.sched_getaffinity(0))
    assert num_processes_for(1) == 1
    assert num_processes_for(1000) == max(1, cpus - 1)
