"""Decode step times with every request constrained, against the same rounds unconstrained, on one engine.

A round queues ``batch`` requests (random prompts, temperature 1, each its own seed) of one kind: unconstrained
(``ignore_eos``, so none ends early), or every request constrained by the same grammar (the typical schema, or the
worst case for the mask fill; workload.py). The round's timed steps are the ``Engine.step`` calls made while all
``batch`` requests decode (after every one has its first token, the first ``SKIP`` such calls left out as the
batch settles, until the first one ends): with async scheduling a call's time is the step's cadence, the device's
step or the host's, whichever is longer. Each call's mask fill on the host (``StructuredOutput.token_bitmask``) is
timed too.

Rounds alternate kinds (unconstrained, constrained, unconstrained, …) and, between passes, the engine's mode
(``async_scheduling`` off and on: ``Engine.step`` reads it every step, and it is switched with no step in
flight), so drift over the run falls on both sides of every comparison.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from services.engine.finish_reason import FinishReason
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint

SKIP = 2  # full-batch calls left out at the start of a round (the step after the last prefill, async's first)
_IDS = itertools.count()


@dataclass
class RoundTimes:
    steps_s: list[float] = field(default_factory=list)  # each timed Engine.step call, seconds
    fill_s: list[float] = field(default_factory=list)  # each timed call's mask fill, seconds (0: none filled)
    num_errors: int = 0  # requests that ended with an error (a grammar's dead end, a failed step): none expected


@contextlib.contextmanager
def timed_fills(engine) -> Iterator[list[float]]:
    """Within the block, each ``engine.structured.token_bitmask`` call's seconds are appended to the yielded list
    (an instance attribute over the method, removed afterwards)."""
    structured = engine.structured
    fill, seconds = structured.token_bitmask, []

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fill(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - start)

    structured.token_bitmask = timed
    try:
        yield seconds
    finally:
        del structured.token_bitmask


def set_async(engine, on: bool) -> None:
    """Switches the engine's async scheduling between rounds (nothing may be in flight)."""
    if engine.has_unfinished():
        raise RuntimeError("async scheduling is switched only between rounds")
    engine.config = engine.config.replace(async_scheduling=on)


def decode_round(llm, batch: int, constraint: Constraint | None, prompt_len: int, steps: int, seed: int) -> RoundTimes:
    """One round (see the module docstring); every request ends (length, stop or error) before it returns."""
    engine = llm.engine
    vocab = llm.source.config.vocab_size
    g = torch.Generator().manual_seed(seed)
    for i in range(batch):
        prompt = torch.randint(3, vocab - 1, (prompt_len,), generator=g).tolist()
        params = SamplingParams(
            temperature=1.0,
            seed=seed * 1000 + i,
            max_tokens=steps + SKIP + 4,
            ignore_eos=constraint is None,
            constraint=constraint,
        )
        engine.add_request(f"structured-bench-{next(_IDS)}", prompt, params)
    times = RoundTimes()
    started: set[str] = set()
    ended = 0
    skipped = 0
    with timed_fills(engine) as fills:
        while engine.has_unfinished():
            decoding = len(started) == batch and not ended
            num_fills = len(fills)
            start = time.perf_counter()
            outs = engine.step()
            seconds = time.perf_counter() - start
            started.update(o.request_id for o in outs if o.token_ids)
            num_ended = sum(1 for o in outs if o.finished)
            times.num_errors += sum(1 for o in outs if o.finish_reason == FinishReason.ERROR)
            ended += num_ended
            if decoding and not num_ended:
                if skipped < SKIP:
                    skipped += 1
                    continue
                times.steps_s.append(seconds)
                times.fill_s.append(sum(fills[num_fills:]))
    return times


def compare(
    llm,
    batches: list[int],
    kinds: dict[str, Constraint | None],
    modes: list[bool],
    rounds: int,
    prompt_len: int,
    steps: int,
    only: dict[str, list[int]] | None = None,
    on_round: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Per mode (async off/on), batch and kind: the pooled timed steps of ``rounds`` rounds, kinds alternated within
    each round and modes between rounds. ``only``: kinds run at these batches only (others at every batch).
    ``on_round``: called with the rows so far after each round (a run cut short keeps what it measured)."""
    pooled: dict[tuple[bool, int, str], RoundTimes] = {}
    for r in range(rounds):
        for on in modes if r % 2 == 0 else list(reversed(modes)):
            set_async(llm.engine, on)
            for batch in batches:
                for name, constraint in kinds.items():
                    if only and name in only and batch not in only[name]:
                        continue
                    t = decode_round(llm, batch, constraint, prompt_len, steps, seed=1 + r)
                    into = pooled.setdefault((on, batch, name), RoundTimes())
                    into.steps_s += t.steps_s
                    into.fill_s += t.fill_s
                    into.num_errors += t.num_errors
        if on_round is not None:
            on_round(summary(pooled))
    return summary(pooled)


def summary(pooled: dict[tuple[bool, int, str], RoundTimes]) -> list[dict]:
    """One row per (async, batch, kind): step and mask-fill figures, and the ratio to the unconstrained row."""
    rows = []
    for (on, batch, name), t in sorted(pooled.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        rows.append(
            {
                "async": on,
                "batch": batch,
                "kind": name,
                "steps": len(t.steps_s),
                "step_ms_median": round(1e3 * statistics.median(t.steps_s), 4) if t.steps_s else None,
                "step_ms_mean": round(1e3 * statistics.mean(t.steps_s), 4) if t.steps_s else None,
                "fill_ms_median": round(1e3 * statistics.median(t.fill_s), 4) if t.fill_s else None,
                "errors": t.num_errors,
            }
        )
    base = {(r["async"], r["batch"]): r["step_ms_median"] for r in rows if r["kind"] == "unconstrained"}
    for r in rows:
        b = base.get((r["async"], r["batch"]))
        r["vs_unconstrained"] = round(r["step_ms_median"] / b, 4) if b and r["step_ms_median"] else None
        # With async scheduling: the bubble the constraint leaves (its step time over the unconstrained one's).
        r["extra_ms"] = round(r["step_ms_median"] - b, 4) if b and r["step_ms_median"] else None
    return rows
