"""Where a decode step's device time goes: the kernels of ``steps`` timed decode steps at one batch
and context (``time_decode``'s setup: real plans, prefill skipped, pools filled), aggregated by kernel
name, with the step's wall time and its floor. ``shinkai bench step --profile`` runs it after the
decode section; the rows name the next kernel to work on."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from services.bench.step_timing import _sync, fill_pools, skip_prefill
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.worker.cache_engine import CacheEngine


def kernel_table(events, num_steps: int, top: int = 20) -> list[dict[str, Any]]:
    """Device events (``torch.profiler`` ``events()``) → the ``top`` kernels by time per step."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if e.device_type.name == "CUDA" and e.device_time > 0:
            total[e.name] += e.device_time
            count[e.name] += 1
    rows = [{"kernel": name, "us_per_step": us / num_steps, "launches_per_step": count[name] / num_steps}
            for name, us in total.items()]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows[:top]


def profile_decode(engine: Engine, cache: CacheEngine, *, batch: int, context: int, steps: int,
                   vocab_size: int, seed: int = 0) -> dict[str, Any]:
    """Profiles ``steps`` decode steps after one warm-up; returns wall ms per step, device-busy ms per
    step and the kernel table. The requests are aborted afterwards (pools whole again)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{i}", torch.randint(3, vocab_size, (context,), generator=gen).tolist(), params)
    skip_prefill(engine)
    fill_pools(cache, seed)
    device = cache.blocks.device
    engine.step()
    _sync(device)
    # Device activity only (host tracing would inflate the wall time); CPU runs trace the host instead.
    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall = time.perf_counter() - t0
    for rid in list(engine.requests):
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    events = prof.events()
    busy_us = sum(e.device_time for e in events if e.device_type.name == "CUDA")
    return {"batch": batch, "context": context, "wall_ms": wall * 1e3 / steps,
            "busy_ms": busy_us * 1e-3 / steps, "kernels": kernel_table(events, steps)}
