"""Timing whole engine steps at a chosen batch and context, without paying for the prefill.

A decode benchmark at 256 requests × 32K context would spend minutes prefilling 8M tokens before
the first timed step. The step cost of decode depends on the rows, the context lengths and the
bytes in the pools, not on which values the pools hold, so the harness:

1. adds the requests to a real ``Engine`` and walks its scheduler through every prefill chunk,
   answering each plan with a stand-in ``StepResult`` (one token per finished prompt) instead of
   running the worker: the scheduler's blocks, slots, positions and plans are exactly the real ones;
2. fills the runner's pools with random entries written through the ``CacheEngine``'s own writers
   (valid FP8/FP4 codes and scales everywhere: no NaN, no all-zero ties for the indexer);
3. times ``engine.step()`` (schedule, execute, sample, update), synchronising the device after
   each, for steps whose plans are pure decode.

Prefill steps are timed the other way: real chunks through the real runner, one request per chunk.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from scheduler_rs import StepResult
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.worker.state.cache_engine import CacheEngine

BAND = 1 << 16  # entries written per call while filling the pools


@dataclass
class StepTimes:
    rows: int
    context: int
    seconds: list[float]  # one per timed step

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def skipped_tokens(batch: int, context: int, budget: int = EngineConfig.max_num_batched_tokens) -> int:
    """The most stand-in tokens ``skip_prefill`` can give one request: one per plan that holds prompt chunks
    (at most one per full budget of the batch's prompts, plus one per prompt for its last partial chunk)."""
    return batch + -(-batch * context // budget)


def decode_model_len(batch: int, context: int, steps: int, budget: int = EngineConfig.max_num_batched_tokens) -> int:
    """The ``max_model_len`` an engine needs for ``time_decode``: the prompt, the stand-in tokens of the
    skipped prompt steps, the timed steps and a margin."""
    return context + skipped_tokens(batch, context, budget) + steps + 16


def skip_prefill(engine: Engine, token_id: int = 3) -> int:
    """Answers every plan holding prompt chunks (prefill, or mixed with the decode rows of prompts already
    skipped) with a stand-in token per sampled row; runs the first plain decode plan for real and stops there.
    Returns the plans skipped."""
    skipped = 0
    sched = engine.scheduler
    while True:
        plan = sched.schedule()
        if plan.kind == "decode":
            # A decode plan was made but not run: close it as failed would end the requests, so run
            # it for real instead — the caller's first timed step is the one after this.
            engine.worker.execute(plan, engine.inputs.rows(plan))
            sched.update(
                plan,
                StepResult(list(plan.num_sample_rows.tolist()), [token_id] * int(sum(plan.num_sample_rows.tolist()))),
            )
            return skipped
        counts = list(plan.num_sample_rows.tolist())
        sched.update(plan, StepResult(counts, [token_id] * sum(counts)))
        skipped += 1


def fill_pools(cache: CacheEngine, seed: int = 0) -> None:
    """Random keys in every ring position and every compressed entry of every block, written by the
    cache's own quantising writers; fp32 partial rows and Engram history stay zero (valid values)."""
    lay, device = cache.layout, cache.blocks.device
    gen = torch.Generator(device=device).manual_seed(seed)
    slots = torch.arange(cache.slots.shape[0], device=device)
    for layer in range(lay.num_layers):
        for r in range(lay.ring_size):
            k = torch.randn(slots.numel(), lay.head_dim, generator=gen, device=device)
            cache.write_window(layer, slots, torch.full_like(slots, r), k)
    for source in lay.sources:
        total = cache.blocks.shape[0] * source.entries_per_block
        for start in range(0, total, BAND):
            entries = torch.arange(start, min(start + BAND, total), device=device)
            kv = torch.randn(entries.numel(), lay.head_dim, generator=gen, device=device)
            keys = torch.randn(entries.numel(), lay.index_head_dim, generator=gen, device=device)
            cache.write_entries(source.layer, entries, kv, keys)


def time_decode(
    engine: Engine,
    cache: CacheEngine,
    *,
    batch: int,
    context: int,
    steps: int,
    vocab_size: int,
    seed: int = 0,
    penalties: bool = False,
) -> StepTimes:
    """``batch`` requests with ``context``-token prompts, prefill skipped, then ``steps`` timed decode
    steps (after one untimed warm-up step). Greedy, ``ignore_eos``: every step keeps all rows. ``penalties``:
    every request also has presence, frequency and repetition penalties, min_p and min_tokens."""
    gen = torch.Generator().manual_seed(seed)
    extra: dict = {}
    if penalties:
        extra = dict(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1, min_p=0.05, min_tokens=steps)
    budget = engine.config.max_num_batched_tokens
    max_tokens = steps + 4 + skipped_tokens(batch, context, budget)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **extra)
    for i in range(batch):
        engine.add_request(
            f"bench-{context}-{batch}-{i}", torch.randint(3, vocab_size, (context,), generator=gen).tolist(), params
        )
    skip_prefill(engine)
    fill_pools(cache, seed)
    device = cache.blocks.device
    ended: dict[str, str] = {}
    for out in engine.step():  # warm-up (compiles, captures a graph if the runner does)
        if out.finish_reason is not None:
            ended[out.request_id] = out.finish_reason
    times = []
    for i in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        outputs = engine.step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        ended.update({o.request_id: o.finish_reason for o in outputs if o.finish_reason is not None})
        plan = engine.last_plan
        if plan is None or plan.is_prefill or plan.num_rows != batch:
            reasons = sorted(set(ended.values()))
            raise RuntimeError(
                f"timed step {i} was not a {batch}-row decode step ({plan and plan.num_rows} rows, "
                f"prefill {plan and plan.is_prefill}); {len(ended)} requests ended ({reasons}); "
                f"{engine.stats()}"
            )
    while engine.has_unfinished():  # drain, so the pools come back whole for the next size
        for request_id in list(engine.requests):
            engine.abort(request_id)
        if engine.has_unfinished():
            engine.step()
    return StepTimes(batch, context, times)


def time_prefill(run_chunk: Callable[[], object], device: torch.device, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        run_chunk()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def time_prompt_step(engine: Engine, device: torch.device, tokens: int, vocab_size: int) -> float:
    """Seconds of the step that prefills one random ``tokens``-token prompt whole, after an untimed one of the
    same size (compiles); each request then runs to its end, so the pools come back whole."""
    seconds = 0.0
    for i in range(2):
        engine.add_request(
            f"p{i}", torch.randint(3, vocab_size, (tokens,)).tolist(), SamplingParams(max_tokens=1, ignore_eos=True)
        )
        _sync(device)
        t0 = time.perf_counter()
        engine.step()
        _sync(device)
        seconds = time.perf_counter() - t0
        while engine.has_unfinished():
            engine.step()
    return seconds


def fit_line(rows: list[int], seconds: list[float]) -> tuple[float, float]:
    """Least-squares a + b·rows."""
    n = len(rows)
    if n < 2:
        return (seconds[0] if seconds else 0.0), 0.0
    mx, my = sum(rows) / n, sum(seconds) / n
    var = sum((x - mx) ** 2 for x in rows)
    b = sum((x - mx) * (y - my) for x, y in zip(rows, seconds)) / var if var else 0.0
    return my - b * mx, b
