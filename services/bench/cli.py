"""`shinkai bench ...` command group."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    targets = bench.add_subparsers(dest="target", required=True)
    sched = targets.add_parser(
        "scheduler",
        help="replay the walkthrough's kitchen, then time schedule()+update() at scale",
    )
    sched.add_argument("--num-requests", type=int, default=256, help="running requests (default 256)")
    sched.add_argument("--nextn", type=int, default=5, help="draft tokens per request (default 5)")
    sched.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    sched.add_argument("--steps", type=int, default=2000, help="timed decode steps")
    sched.add_argument("--json", dest="json_path", help="write the figures as JSON here")
    sched.add_argument("--baseline", help="JSON from an earlier run, to report the ratio against it")
    sched.set_defaults(func=_run_scheduler)


def _run_scheduler(args: argparse.Namespace) -> int:
    from services.bench import scheduler

    return scheduler.main(args)
