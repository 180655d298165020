"""The host's structured-output costs outside a step: grammar compiles over the repository's constraint set, and the
per-step mask fill along random walks of a grammar.

Compiles: a fresh ``GrammarCompiler`` on the model's tokenizer (one compile thread, as an engine has); the first
compile builds the vocabulary's tables and is reported apart, then every constraint of the set once, each timed
from ``compile`` (the parse, on the caller's thread) to its future's result: what a request waits behind the gate.

Mask fill: a matcher walks ``num_walks`` random paths of the grammar (each step a token drawn uniformly from those
its mask allows, the stop token only once nothing else is allowed), and each step's ``fill_rows`` for one row is
timed: the host work a constrained request adds to every decode step.
"""

from __future__ import annotations

import random
import statistics
import time

from services.engine.structured.constraint import Constraint
from services.engine.structured.grammars import GrammarCompiler
from services.engine.structured.token_masks import fill_rows
from services.worker.sampling.token_bitmask import allowed_tokens


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` quantile (0 < q ≤ 1) of ``values``."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q * len(ordered) + 0.5) - 1))]


def summary_ms(seconds: list[float]) -> dict:
    """Median, p99 and max in ms, and the count."""
    ms = [1e3 * s for s in seconds]
    return {
        "n": len(ms),
        "median_ms": round(statistics.median(ms), 4),
        "p99_ms": round(percentile(ms, 0.99), 4),
        "max_ms": round(max(ms), 4),
    }


def compile_times(tokenizer, vocab_size: int, eos_token_id: int, constraints: list[tuple[str, Constraint]]) -> dict:
    """The first compile (the vocabulary's tables) and each constraint's compile, in ms (see the module docstring)."""
    grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_id)
    try:
        start = time.perf_counter()
        grammars.compile(Constraint("regex", "a")).result()
        first = time.perf_counter() - start
        each: dict[str, float] = {}
        for name, constraint in constraints:
            start = time.perf_counter()
            grammars.compile(constraint).result()
            each[name] = time.perf_counter() - start
    finally:
        grammars.close()
    slowest = max(each, key=each.__getitem__)
    return {
        "first_compile_ms": round(1e3 * first, 1),
        **summary_ms(list(each.values())),
        "slowest": slowest,
    }


def fill_times(grammars: GrammarCompiler, constraint: Constraint, num_walks: int, max_steps: int, seed: int) -> dict:
    """Each step's one-row mask fill along ``num_walks`` random walks of ``constraint``'s grammar (ms), and the
    walks' mean length in tokens."""
    compiled = grammars.compile(constraint).result()
    rng = random.Random(seed)
    seconds: list[float] = []
    lengths = []
    for _ in range(num_walks):
        matcher = grammars.matcher(compiled)
        steps = 0
        while steps < max_steps and not matcher.is_terminated():
            mask = grammars.bitmask(1)
            start = time.perf_counter()
            fill_rows(matcher, mask, 0, ())
            seconds.append(time.perf_counter() - start)
            allowed = allowed_tokens(mask, grammars.vocab_size, "cpu")[0].nonzero().flatten().tolist()
            stops = set(matcher.stop_token_ids)
            choices = [t for t in allowed if t not in stops] or allowed
            if not choices or not matcher.accept_token(rng.choice(choices)):
                break
            steps += 1
        lengths.append(steps)
    return {**summary_ms(seconds), "mean_walk_tokens": round(statistics.mean(lengths), 1)}
