"""Scheduler benchmark: the kitchen replay, then schedule() + update() per decode step at scale.

The stand-in worker accepts a fixed share of drafts so blocks are claimed and returned as in real
speculative decoding; building its StepResult is timed apart from the scheduler's own calls.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from scheduler_rs import Scheduler, SchedulerConfig, StepResult
from services.bench.targets import Target, past, verdict_lines

KITCHEN = (("A", 6), ("B", 5), ("C", 4))
TARGET_US = 200.0
"""Schedule plus update of one decode step, in microseconds, at every statistic (mean, p50, p99)."""


def kitchen_table() -> list[str]:
    """The walkthrough's A/B/C kitchen with an 8-token budget, one line per step."""
    scheduler = Scheduler(
        SchedulerConfig(
            block_size=4,
            num_blocks=64,
            num_state_slots=8,
            max_num_seqs=256,
            max_num_batched_tokens=8,
            max_model_len=1 << 20,
        )
    )
    eos = 1
    words = {50: '"and"', 51: '"slept"', 52: '"."', eos: "the end token"}
    a_tokens = {6: 50, 7: 51, 8: 52, 9: eos}
    for request_id, n in KITCHEN:
        scheduler.add_request(request_id, list(range(10, 10 + n)), max_tokens=16, eos_token_id=eos)
    lines = []
    for number in range(1, 7):
        plan = scheduler.schedule()
        starts = plan.query_start.tolist()
        positions = plan.positions.tolist()
        tokens, counts = [], []
        for i, request_id in enumerate(plan.request_ids):
            n = plan.num_sample_rows.tolist()[i]
            counts.append(n)
            if n:
                position = plan.seqlens_k.tolist()[i]
                tokens.append(a_tokens[position] if request_id == "A" else 60 + position)
        outputs = scheduler.update(plan, StepResult(counts, tokens))
        if plan.is_prefill:
            rows = "  ".join(
                f"{request_id}[{positions[starts[i]]}..{positions[starts[i + 1] - 1]}]"
                for i, request_id in enumerate(plan.request_ids)
            )
        else:
            rows = "  ".join(plan.request_ids)
        got = ", ".join(
            f"{o.request_id} gets {words[o.token_ids[0]] if o.request_id == 'A' else 'a token'}"
            + (" and leaves" if o.finished else "")
            for o in outputs
        )
        lines.append(f"step {number}  {plan.kind:<8} {rows:<24} -> {got}")
    return lines


def time_steps(num_requests: int, nextn: int, context: int, num_steps: int) -> dict:
    block_size = 128
    blocks_per_request = -(-(context + num_steps * (nextn + 1) + nextn + 1) // block_size)
    config = SchedulerConfig(
        block_size=block_size,
        num_blocks=num_requests * blocks_per_request + 1,
        num_state_slots=num_requests + 1,
        max_num_seqs=num_requests,
        max_num_batched_tokens=32768,
        max_model_len=1 << 20,
        nextn=nextn,
        prefill_max_cache_usage=1.0,
    )
    scheduler = Scheduler(config)
    for i in range(num_requests):
        scheduler.add_request(f"req-{i}", [7] * context, max_tokens=1 << 30, ignore_eos=True)
    while scheduler.stats().num_waiting:
        plan = scheduler.schedule()
        counts = plan.num_sample_rows.tolist()
        scheduler.update(plan, StepResult(counts, [9] * sum(counts)))
    drafts = [nextn] * num_requests
    draft_ids = [11] * (nextn * num_requests)
    # Accept half the drafts on every other request: blocks are claimed and returned.
    accepted = [1 + (nextn // 2 if i % 2 else nextn) for i in range(num_requests)]
    tokens = [9] * sum(accepted)
    schedule_us, result_us, update_us = [], [], []
    clock = time.perf_counter_ns
    for _ in range(num_steps):
        t0 = clock()
        plan = scheduler.schedule()
        t1 = clock()
        result = StepResult(accepted, tokens, drafts, draft_ids)
        t2 = clock()
        scheduler.update(plan, result)
        t3 = clock()
        schedule_us.append((t1 - t0) / 1e3)
        result_us.append((t2 - t1) / 1e3)
        update_us.append((t3 - t2) / 1e3)
    assert plan.num_requests == num_requests and plan.num_rows == num_requests * (1 + nextn)
    scheduler.check_invariants()
    total = [a + b for a, b in zip(schedule_us, update_us)]

    def summary(values: list[float]) -> dict:
        ordered = sorted(values)
        return {
            "mean_us": round(statistics.fmean(values), 1),
            "p50_us": round(ordered[len(ordered) // 2], 1),
            "p99_us": round(ordered[int(len(ordered) * 0.99)], 1),
        }

    return {
        "num_requests": num_requests,
        "nextn": nextn,
        "context": context,
        "num_steps": num_steps,
        "rows_per_step": num_requests * (1 + nextn),
        "schedule": summary(schedule_us),
        "update": summary(update_us),
        "schedule_plus_update": summary(total),
        "build_result": summary(result_us),
    }


def main(args: argparse.Namespace) -> int:
    print("Kitchen (walkthrough Pass 0): A = 6 tokens, B = 5, C = 4, budget 8 tokens per prefill step")
    for line in kitchen_table():
        print("  " + line)
    print()
    figures = time_steps(args.num_requests, args.nextn, args.context, args.steps)
    figures["machine"] = f"{platform.machine()} {platform.processor() or ''} python {sys.version.split()[0]}".strip()
    figures["date"] = time.strftime("%Y-%m-%d")
    print(
        f"Decode steps at scale: {figures['num_requests']} running requests, nextn {figures['nextn']} "
        f"({figures['rows_per_step']} rows), {figures['context']}-token context, {figures['num_steps']} steps"
    )
    for key in ("schedule", "update", "schedule_plus_update", "build_result"):
        s = figures[key]
        print(f"  {key:<22} mean {s['mean_us']:>8.1f} us   p50 {s['p50_us']:>8.1f} us   p99 {s['p99_us']:>8.1f} us")
    both = figures["schedule_plus_update"]
    targets = [
        Target(f"{k.removesuffix('_us')} schedule+update (us)", both[k], TARGET_US)
        for k in ("mean_us", "p50_us", "p99_us")
    ]
    print(f"  target: schedule+update under {TARGET_US:.0f} us per step, at the mean, p50 and p99")
    for line in verdict_lines(targets):
        print("    " + line)
    figures["target_us"] = TARGET_US
    figures["past_target"] = past(targets)
    if args.baseline:
        base = json.loads(Path(args.baseline).read_text())
        ratio = figures["schedule_plus_update"]["p50_us"] / base["schedule_plus_update"]["p50_us"]
        figures["ratio_to_baseline_p50"] = round(ratio, 3)
        print(f"  against the baseline ({args.baseline}): {ratio:.2f}x its p50 time")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(figures, indent=2) + "\n")
    return 0
