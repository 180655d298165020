"""The EPLB planner process: ``python -m services.entrypoints.eplb --num-experts E --num-gpus G ...``.

Subscribes to the engines' expert loads over NATS, publishes plans (services/eplb/service.py), serves
grpc.health.v1 and Prometheus metrics, and drains on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from observability import tracing
from services import subjects
from services.eplb.guarded import POLICIES, PlanConfig
from services.eplb.planner import PlannerConfig
from services.eplb.service import PlannerService, ServiceConfig

DESCRIPTION = "The EPLB planner service: expert loads in over NATS, placement plans out."


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m services.entrypoints.eplb", description=DESCRIPTION)
    p.add_argument("--nats-url", default="nats://127.0.0.1:4222")
    p.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to reach NATS at start-up")
    p.add_argument("--health-addr", default="127.0.0.1:0", help="grpc.health.v1 bind address (port 0: any)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus port (0: any; default: none)")
    p.add_argument("--num-experts", type=int, required=True, help="logical experts per layer")
    p.add_argument("--num-gpus", type=int, required=True)
    p.add_argument("--num-redundant", type=int, required=True)
    p.add_argument("--num-layers", type=int, required=True)
    p.add_argument("--num-ranks", type=int, default=1, help="engine ranks reporting each step")
    p.add_argument("--interval", type=int, default=10_000, help="re-plan every K steps, first at K/4")
    p.add_argument("--window", type=int, default=1_000)
    p.add_argument(
        "--holdout",
        type=int,
        default=None,
        help="latest window steps kept for scoring only (default: window // 4; 0: off)",
    )
    p.add_argument("--policy", choices=POLICIES, default="guarded")
    p.add_argument("--threshold", type=float, default=0.01)
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.002,
        help="guarded: moe_lb above the best found worth accepting to move fewer experts",
    )
    return p


async def _main(args: argparse.Namespace) -> int:
    config = ServiceConfig(
        planner=PlannerConfig(
            num_logical=args.num_experts,
            num_gpus=args.num_gpus,
            num_redundant=args.num_redundant,
            num_layers=args.num_layers,
            num_ranks=args.num_ranks,
            interval=args.interval,
            window=args.window,
            holdout=args.window // 4 if args.holdout is None else args.holdout,
            plan=PlanConfig(policy=args.policy, threshold=args.threshold, tolerance=args.tolerance),
        ),
        nats_url=args.nats_url,
        health_addr=args.health_addr,
        metrics_port=args.metrics_port,
    )
    tracing.setup("shinkai-eplb")
    service = PlannerService(config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, service.request_stop)
    if not await service.start_or_stop(args.connect_timeout):
        if service.stop_requested:
            print("eplb planner: stopped before it was ready", flush=True)
            return 0
        print(
            f"eplb planner: error: could not start with NATS at {args.nats_url} within {args.connect_timeout} s",
            file=sys.stderr,
        )
        return 1
    print(
        f"eplb planner ready: health port {service.health_port}, metrics port {service.metrics_port}, "
        f"subscribed to {subjects.every_replica(subjects.EXPERT_LOAD)}",
        flush=True,
    )
    await service.run_until_stopped()
    print(f"eplb planner drained: {service.planner.version} plans published", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return asyncio.run(_main(args))
    except ValueError as err:
        print(f"eplb planner: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
