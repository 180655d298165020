"""Where a step's device time goes: the kernels of ``steps`` decode steps at one batch and context
(``time_decode``'s setup: real plans, prefill skipped, pools filled), or of one prefill chunk,
aggregated by kernel name, with the step's wall time. ``shinkai bench step --profile`` runs both;
the rows name the next kernel to work on."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import torch

from services.bench.step.timing import _sync, fill_pools, skip_prefill, skipped_tokens
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.worker.state.cache_engine import CacheEngine


def kernel_table(events, num_steps: int, top: int | None = 20) -> list[dict[str, Any]]:
    """Device events (``torch.profiler`` ``events()``) → the ``top`` kernels by time per step (None: every one)."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for e in events:
        if e.device_type.name == "CUDA" and e.device_time > 0:
            total[e.name] += e.device_time
            count[e.name] += 1
    rows = [
        {"kernel": name, "us_per_step": us / num_steps, "launches_per_step": count[name] / num_steps}
        for name, us in total.items()
    ]
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows if top is None else rows[:top]


def kernel_diff(without: list[dict[str, Any]], with_: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Two kernel tables (``kernel_table``'s rows, every kernel: ``top=None``) of the same steps built two ways →
    every kernel of either, with both sides' launches and µs per step and the differences, most added time
    first. A kernel absent from one side counts 0 there."""
    a = {r["kernel"]: r for r in without}
    b = {r["kernel"]: r for r in with_}
    rows = []
    for name in a.keys() | b.keys():
        n0, n1 = (t[name]["launches_per_step"] if name in t else 0.0 for t in (a, b))
        us0, us1 = (t[name]["us_per_step"] if name in t else 0.0 for t in (a, b))
        rows.append(
            {
                "kernel": name,
                "launches_without": n0,
                "launches_with": n1,
                "us_without": us0,
                "us_with": us1,
                "extra_launches": n1 - n0,
                "extra_us": us1 - us0,
            }
        )
    rows.sort(key=lambda r: (-r["extra_us"], r["kernel"]))
    return rows


COPY_PREFIXES = ("Memcpy", "Memset")
"""Device events the profiler names for copies and fills (cudaMemcpy/cudaMemset), not kernel launches."""


def launch_totals(events, num_steps: int) -> dict[str, float]:
    """Device events → per step: kernel launches and their summed device time (every kernel, not only the
    table's top rows: the step's launch count), and the copies/fills beside them. Zero-time events are
    left out, as in ``kernel_table``."""
    kernels = copies = 0
    kernel_us = copy_us = 0.0
    for e in events:
        if e.device_type.name != "CUDA" or e.device_time <= 0:
            continue
        if e.name.startswith(COPY_PREFIXES):
            copies, copy_us = copies + 1, copy_us + e.device_time
        else:
            kernels, kernel_us = kernels + 1, kernel_us + e.device_time
    return {
        "launches_per_step": kernels / num_steps,
        "kernel_ms": kernel_us * 1e-3 / num_steps,
        "copies_per_step": copies / num_steps,
        "copy_ms": copy_us * 1e-3 / num_steps,
    }


def launches_line(p: dict[str, Any]) -> str:
    """A profile's launch totals (``launch_totals``' keys) in one line."""
    return (
        f"{p['launches_per_step']:.0f} kernel launches per step, {p['kernel_ms']:.2f} ms in kernels, "
        f"{p['copies_per_step']:.0f} copies/fills {p['copy_ms']:.2f} ms"
    )


def print_kernels(kernels: list[dict[str, Any]]) -> None:
    """A kernel table (``kernel_table``'s rows), one line each: µs and launches per step, the name."""
    for k in kernels:
        print(f"  {k['us_per_step']:10.1f} µs  ×{k['launches_per_step']:6.1f}  {k['kernel'][:90]}")


def device_trace(device: torch.device):
    """A profiler of the device's kernels (device activity only: host tracing would inflate the wall
    time); on the CPU, of the host ops, so the code path runs in CPU tests."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU])


def profile_summary(prof, wall: float, num_steps: int, top: int | None = 20) -> dict[str, Any]:
    events = prof.events()
    busy_us = sum(e.device_time for e in events if e.device_type.name == "CUDA")
    return {
        "wall_ms": wall * 1e3 / num_steps,
        "busy_ms": busy_us * 1e-3 / num_steps,
        **launch_totals(events, num_steps),
        "kernels": kernel_table(events, num_steps, top),
    }


def profile_prefill(engine: Engine, device: torch.device, *, tokens: int, vocab_size: int) -> dict[str, Any]:
    """Profiles the one step that prefills a ``tokens``-token prompt (after a warm-up prompt); the engine's
    max_num_batched_tokens must be ≥ ``tokens``."""
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    result: dict[str, Any] = {}
    for i in range(2):
        engine.add_request(f"profile-p{i}", torch.randint(3, vocab_size, (tokens,)).tolist(), params)
        _sync(device)
        with device_trace(device) as prof:
            t0 = time.perf_counter()
            engine.step()
            _sync(device)
            wall = time.perf_counter() - t0
        if not engine.last_plan.is_prefill or engine.last_plan.num_rows != tokens:
            raise RuntimeError(f"the profiled step was not the {tokens}-token prefill")
        while engine.has_unfinished():
            engine.step()
        result = {"tokens": tokens, **profile_summary(prof, wall, 1)}
    return result


def profile_decode(
    engine: Engine,
    cache: CacheEngine,
    *,
    batch: int,
    context: int,
    steps: int,
    vocab_size: int,
    seed: int = 0,
    top: int | None = 20,
) -> dict[str, Any]:
    """Profiles ``steps`` decode steps after one warm-up; returns wall ms per step, device-busy ms per
    step and the kernel table (its ``top`` rows; None: every kernel). The requests are aborted afterwards
    (pools whole again)."""
    gen = torch.Generator().manual_seed(seed)
    max_tokens = steps + 4 + skipped_tokens(batch, context, engine.config.max_num_batched_tokens)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"profile-{i}", torch.randint(3, vocab_size, (context,), generator=gen).tolist(), params)
    skip_prefill(engine)
    fill_pools(cache, seed)
    device = cache.blocks.device
    engine.step()
    _sync(device)
    with device_trace(device) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        _sync(device)
        wall = time.perf_counter() - t0
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished():
        engine.step()
    return {"batch": batch, "context": context, **profile_summary(prof, wall, steps, top)}
