"""`shinkai bench step --dp N`: decode steps of N data-parallel ranks in lockstep, and the expert exchange's
share of each step.

Every rank gets the same batch (B requests of a short prompt, ``ignore_eos``), the group prefills it at the
first ALL point, then decodes. Per decode step and rank: the step's wall time, and the seconds spent inside
the exchange's calls (``Exchange.seconds``: dispatch and combine of every MoE layer). A collective also
waits for the slowest rank, so the exchange's time holds that wait: its share is what the step loses to
the exchange plus imbalance, not wire time alone. The step's time is the slowest rank's (lockstep).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from typing import Any

PROMPT_TOKENS = 8


def time_rank(rank, batch: int, steps: int) -> list[tuple[float, float]]:
    """On one rank (in lockstep with the others): (step seconds, exchange seconds) of each decode step with rows."""
    from services.engine.sampling_params import SamplingParams

    engine, exchange = rank.engine, rank.parallel.exchange
    for i in range(batch):
        prompt = [1 + (rank.rank * batch + i + j) % 1000 for j in range(PROMPT_TOKENS)]
        engine.add_request(
            f"bench-r{rank.rank}-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        )
    timed = []
    while rank.vote.any_rank(engine.has_unfinished()):
        before, start = exchange.seconds, time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - start
        plan = engine.last_plan
        if plan is not None and plan.kind == "decode" and not plan.is_placeholder:
            timed.append((seconds, exchange.seconds - before))
    return timed


def main(args: argparse.Namespace) -> int:
    import platform

    import torch

    from services.engine.config import EngineConfig
    from services.engine.model_source import load_model
    from services.engine.parallel.rank import RankSpec
    from services.engine.parallel.ranks import Ranks

    if torch.cuda.is_available():
        raise SystemExit("bench step --dp runs on CPU so far (the NCCL exchange has not run on GPUs here)")
    model = args.model or "tiny"
    try:
        batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else (1, 4)
    except ValueError:
        raise SystemExit(f"--batches: expected comma-separated integers, got {args.batches!r}") from None
    if any(b <= 0 for b in batches):
        raise SystemExit(f"--batches: sizes must be positive, got {args.batches!r}")
    steps = 8
    config = EngineConfig(
        data_parallel_size=args.dp,
        max_num_seqs=max(batches),
        max_model_len=PROMPT_TOKENS + steps + 16,
        max_num_batched_tokens=max(batches) * PROMPT_TOKENS,
        block_size=16,
        device="cpu",
        batch_invariant=args.batch_invariant,
    )
    ranks = Ranks(RankSpec(config, partial(load_model, model, 0), "", "cpu", 1))
    print(f"model {model}, {args.dp} ranks (gloo, 1 thread each), device {platform.processor() or 'cpu'}")
    rows: list[dict[str, Any]] = []
    try:
        for batch in batches:
            per_rank = ranks.call(time_rank, batch, steps)
            num_steps = min(len(t) for t in per_rank)
            step_s = [max(t[i][0] for t in per_rank) for i in range(num_steps)]  # lockstep: the slowest rank
            share = [t[i][1] / t[i][0] for t in per_rank for i in range(num_steps)]
            row = {
                "section": "dp decode",
                "dp": args.dp,
                "batch_per_rank": batch,
                "steps": num_steps,
                "step_ms": statistics.median(step_s) * 1e3,
                "exchange_ms": statistics.median(t[i][1] for t in per_rank for i in range(num_steps)) * 1e3,
                "exchange_share": statistics.median(share),
            }
            rows.append(row)
            print(
                f"dp {args.dp} decode batch {batch:>3}/rank: step {row['step_ms']:8.2f} ms, exchange "
                f"{row['exchange_ms']:7.2f} ms ({100 * row['exchange_share']:.0f}% of the step, median over "
                f"ranks and {num_steps} steps)"
            )
    finally:
        ranks.close()
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    return 0
