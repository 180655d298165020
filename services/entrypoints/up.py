"""`shinkai up` and `shinkai down`: the local stack of separate processes (services/entrypoints/stack.py)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from services.entrypoints.stack_config import StackConfig

_DEFAULTS = StackConfig()


def register(subparsers: argparse._SubParsersAction) -> None:
    up = subparsers.add_parser(
        "up", help="start the stack (nats, tokenizer, eplb, [workers,] engines, gateway) as processes"
    )
    up.add_argument("--model", default="tiny", help="checkpoint directory or preset name (default: tiny)")
    up.add_argument("--num-engines", type=int, default=1, help="independent engine replicas (default 1)")
    up.add_argument("--http-port", type=int, default=_DEFAULTS.http_port, help="gateway HTTP port (0: any free)")
    up.add_argument("--grpc-port", type=int, default=_DEFAULTS.grpc_port, help="gateway gRPC port (0: any free)")
    up.add_argument("--nats-port", type=int, default=0, help="nats-server port (0: any free)")
    up.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once per engine")
    up.add_argument("--max-model-len", type=int, default=None, help="prompt plus output tokens per request")
    from services.engine.device import add_device_arguments

    add_device_arguments(up)
    up.add_argument(
        "--remote-workers",
        action="store_true",
        help="run each engine's worker as its own process (worker.v1) instead of in-process",
    )
    up.add_argument(
        "--allow-private-image-urls",
        action="store_true",
        help="the gateway fetches image URLs that resolve to private, loopback or link-local addresses",
    )
    up.add_argument(
        "--batch-invariant",
        action="store_true",
        help="same request, same bits alone or in any batch (docs/batch-invariance.md; slower)",
    )
    up.add_argument(
        "--engram-on-host",
        action="store_true",
        help=(
            "Engram tables in host shared memory, one copy per host; each step copies only its rows to the device "
            "(docs/parallelism.md)"
        ),
    )
    from services.engine.config_flags import add_parallel_arguments, add_speculative_arguments, add_step_arguments

    add_speculative_arguments(up)

    add_step_arguments(up)
    add_parallel_arguments(up)
    from services.gateway.admission import add_admission_arguments
    from services.gateway.http_timeouts import add_http_timeout_arguments

    add_http_timeout_arguments(up)
    add_admission_arguments(up)
    up.add_argument("--run-dir", type=Path, default=_DEFAULTS.run_dir, help="logs and PIDs (default: %(default)s)")
    up.add_argument(
        "--timeout",
        type=float,
        default=180.0,
        help="seconds each service gets to become healthy; a starting engine or worker gets them again from each "
        "startup step it reports (a phase begun, a part loaded, a graph captured)",
    )
    up.add_argument(
        "--api-key",
        default=None,
        help="key the gateway requires (HTTP Bearer, gRPC metadata); "
        "passed in its environment only (default: $SHINKAI_API_KEY; none: open)",
    )
    up.add_argument(
        "--restart-limit",
        type=int,
        default=_DEFAULTS.restart_limit,
        help="the supervisor restarts a crashed service at most this many times in a row (default %(default)s)",
    )
    up.add_argument(
        "--no-supervisor", action="store_true", help="no supervisor: a crashed service stays down until `down`"
    )
    up.set_defaults(func=_up)
    down = subparsers.add_parser("down", help="stop the stack that `shinkai up` started, gracefully")
    down.add_argument("--run-dir", type=Path, default=_DEFAULTS.run_dir)
    down.add_argument("--timeout", type=float, default=60.0, help="seconds each service gets to drain")
    down.set_defaults(func=_down)
    status = subparsers.add_parser(
        "status", help="each service of the stack `shinkai up` started: PID, state, restarts"
    )
    status.add_argument("--run-dir", type=Path, default=_DEFAULTS.run_dir)
    status.set_defaults(func=_status)


def _up(args: argparse.Namespace) -> int:
    from services.entrypoints.cli import UsageError
    from services.entrypoints.stack import up

    if args.num_engines < 1:
        raise UsageError("--num-engines must be at least 1")
    if args.spec_varlen and not args.num_speculative_tokens:
        raise UsageError("--spec-varlen needs --num-speculative-tokens > 0")
    if args.data_parallel_size < 1:
        raise UsageError("--dp must be at least 1")
    if args.num_speculative_tokens and args.remote_workers:
        raise UsageError(
            "--num-speculative-tokens needs in-process workers: a remote worker's protocol does not "
            "carry drafts yet; drop --remote-workers"
        )
    from services.engine.config_flags import step_args
    from services.engine.device import device_args
    from services.gateway.admission import admission_limits
    from services.gateway.http_timeouts import http_timeouts

    config = StackConfig(
        model=args.model,
        num_engines=args.num_engines,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        nats_port=args.nats_port,
        run_dir=args.run_dir,
        max_num_seqs=args.max_num_seqs,
        remote_workers=args.remote_workers,
        max_model_len=args.max_model_len,
        device_args=tuple(device_args(args).items()),
        batch_invariant=args.batch_invariant,
        engram_on_host=args.engram_on_host,
        num_speculative_tokens=args.num_speculative_tokens,
        spec_sampling=args.spec_sampling,
        spec_varlen=args.spec_varlen,
        step_args=tuple(step_args(args).items()),
        allow_private_image_urls=args.allow_private_image_urls,
        http_timeouts=http_timeouts(args),
        admission=admission_limits(args),
        data_parallel_size=args.data_parallel_size,
        num_redundant_experts=args.num_redundant_experts,
        supervise=not args.no_supervisor,
        restart_limit=args.restart_limit,
    )
    try:
        if Path(args.model).is_dir() and args.load_format != "dummy":
            from services.worker.kernel_model.weight_loader import check_checkpoint

            check_checkpoint(args.model)  # headers only: a damaged checkpoint fails before any process starts
        up(config, timeout_s=args.timeout, api_key=args.api_key)  # into the gateway's environment only
    except (RuntimeError, FileNotFoundError, ValueError) as err:
        raise UsageError(str(err)) from err
    from services.entrypoints.invocation import shinkai_command

    stop = f"{shinkai_command()} down --run-dir {shlex.quote(str(args.run_dir))}"
    print(f"logs in {args.run_dir / 'logs'}; stop with: {stop}")
    return 0


def _down(args: argparse.Namespace) -> int:
    from services.entrypoints.stack import down

    down(args.run_dir, timeout_s=args.timeout)
    return 0


def _status(args: argparse.Namespace) -> int:
    """Prints the stack's services as stack.json records them; exit 1 when one has failed or none is recorded."""
    import json

    from services.entrypoints.probe import alive_as

    path = args.run_dir / "stack.json"
    if not path.exists():
        print(f"no stack recorded in {args.run_dir}")
        return 1
    state = json.loads(path.read_text())
    num_failed = 0
    for s in state["services"]:
        running = alive_as(s["pid"], s["argv"])
        what = s.get("state", "running") if running or s.get("state") != "running" else "gone"
        num_failed += what in ("failed", "gone")
        print(f"{s['name']:<12} pid {s['pid']:<7} {what:<10} restarts {s.get('restarts', 0)}")
    supervisor = state.get("supervisor")
    if supervisor is not None:
        running = alive_as(supervisor["pid"], supervisor["argv"])
        print(
            f"{'supervisor':<12} pid {supervisor['pid']:<7} {'running' if running else 'gone':<10} {supervisor['url']}"
        )
    else:
        print("no supervisor: crashed services stay down")
    return 1 if num_failed else 0
