"""`shinkai serve`: the whole server in one process (HTTP + gRPC, no NATS). SIGTERM or Ctrl-C drains."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("serve", help="serve HTTP (OpenAI) and gRPC from one process")
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset name (default: tiny)")
    p.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback)")
    p.add_argument("--http-port", type=int, default=8000, help="0: any free port")
    p.add_argument("--grpc-port", type=int, default=50051, help="0: any free port")
    p.add_argument("--max-queued", type=int, default=None, help="unfinished requests before 429")
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests running at once")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt plus output tokens")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="seconds live requests get on SIGTERM")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="same request, same bits alone or in any batch (docs/batch-invariance.md; slower)",
    )
    p.add_argument(
        "--engram-on-host",
        action="store_true",
        help=(
            "Engram tables in host shared memory, one copy per host; each step copies only its rows to the device "
            "(docs/parallelism.md)"
        ),
    )
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="key HTTP (Authorization: Bearer) and gRPC callers must send; repeat for several "
        "(default: $SHINKAI_API_KEY, comma-separated; none: open)",
    )
    p.add_argument("--ssl-certfile", default=None, help="PEM certificate: serve HTTPS and TLS gRPC")
    p.add_argument("--ssl-keyfile", default=None, help="PEM private key of --ssl-certfile")
    p.add_argument(
        "--allow-private-image-urls",
        action="store_true",
        help="fetch image URLs that resolve to private, loopback or link-local addresses (default: refused)",
    )
    from services.engine.config_flags import add_parallel_arguments, add_speculative_arguments, add_step_arguments
    from services.engine.device import add_device_arguments
    from services.gateway.admission import add_admission_arguments
    from services.gateway.http_timeouts import add_http_timeout_arguments

    add_http_timeout_arguments(p)
    add_admission_arguments(p)

    add_device_arguments(p)
    add_speculative_arguments(p)
    add_step_arguments(p)
    add_parallel_arguments(p)
    p.set_defaults(func=_run)


def _config(args: argparse.Namespace):
    from services.gateway.admission import admission_limits
    from services.gateway.auth import Keys, tls_files
    from services.gateway.http_timeouts import http_timeouts
    from services.gateway.server import ServeConfig

    engine_args = {
        k: v for k, v in (("max_num_seqs", args.max_num_seqs), ("max_model_len", args.max_model_len)) if v is not None
    }
    if args.batch_invariant:
        engine_args["batch_invariant"] = True
    if args.engram_on_host:
        engine_args["engram_on_host"] = True
    from services.engine.device import device_args

    engine_args.update(device_args(args))
    from services.engine.config_flags import speculative_args, step_args

    engine_args.update(speculative_args(args))
    engine_args.update(step_args(args))
    extra = {"max_queued": args.max_queued} if args.max_queued is not None else {}
    extra["api_keys"] = Keys.parse(args.api_key)
    extra["tls"] = tls_files(args.ssl_certfile, args.ssl_keyfile)
    extra["allow_private_image_urls"] = args.allow_private_image_urls
    extra["http_timeouts"] = http_timeouts(args)
    extra["admission"] = admission_limits(args)
    return ServeConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        drain_timeout_s=args.drain_timeout,
        engine_args=engine_args,
        **extra,
    )


def _rank_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags each rank process of `serve --dp N` gets (services/entrypoints/engine.py)."""
    from services.engine.config_flags import step_args, step_argv
    from services.engine.device import device_args, device_argv

    argv = ["--drain-timeout", str(args.drain_timeout), *device_argv(device_args(args)), *step_argv(step_args(args))]
    if args.num_speculative_tokens:  # each rank verifies its own requests' drafts (docs/parallelism.md)
        argv += ["--num-speculative-tokens", str(args.num_speculative_tokens), "--spec-sampling", args.spec_sampling]
    argv += ["--spec-varlen"] if args.spec_varlen else []  # without drafts: the rank's config refuses it by name
    argv += ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs is not None else []
    argv += ["--max-model-len", str(args.max_model_len)] if args.max_model_len is not None else []
    argv += ["--engram-on-host"] if args.engram_on_host else []
    return argv + (["--batch-invariant"] if args.batch_invariant else [])


def _stop_on_signals() -> asyncio.Event:
    """An event that SIGTERM or SIGINT sets: serving drains once it is set."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def _serve_ranks(args: argparse.Namespace) -> int:
    """`serve --dp N`: the ranks as child processes, this process their gateway (services/gateway/rank_server.py)."""
    from services.gateway.rank_group import RankGroup
    from services.gateway.rank_server import RankServer

    config = _config(args)
    argv = _rank_argv(args)
    server = RankServer(
        config, RankGroup(args.model, args.data_parallel_size, args.num_redundant_experts, args.host, argv)
    )
    stop = _stop_on_signals()
    await server.start()
    print(
        json.dumps(
            {
                "event": "ready",
                **server.urls(),
                "model": server.frontend.served_model,
                "ranks": [p.pid for p in server.group.processes],
            }
        ),
        flush=True,
    )
    await stop.wait()
    print(json.dumps({"event": "draining"}), flush=True)
    codes = await server.stop()
    print(json.dumps({"event": "stopped", "rank_exit_codes": codes}), flush=True)
    return 0


async def _serve(args: argparse.Namespace) -> int:
    from observability import tracing
    from services.gateway.server import Server

    tracing.setup("shinkai")
    if args.data_parallel_size > 1:
        return await _serve_ranks(args)
    from services.gateway.startup_server import StartupServer
    from services.worker import compile_stats, startup

    compile_stats.install()
    config = _config(args)
    # Until the engine is built, its ports answer /health and grpc.health with the startup phase
    # (services/worker/startup.py); then the server takes the same ports over.
    starting = StartupServer(startup.PROGRESS, config.host, config.grpc_port, config.http_port, config.tls)
    await starting.start()
    try:
        config = dataclasses.replace(config, http_port=starting.http_port, grpc_port=starting.grpc_port)
        server = await asyncio.to_thread(Server, config)
    finally:
        await starting.stop()
    stop = _stop_on_signals()
    await server.start()
    # One machine-readable line, then the URLs for people; `shinkai up` and tests read the first.
    print(
        json.dumps(
            {
                "event": "ready",
                **server.urls(),
                "model": server.frontend.served_model,
                "runner": type(server.llm.engine.worker.runner).__name__,
                "scheduling": server.llm.config.scheduling,
                "max_num_batched_tokens": server.llm.config.max_num_batched_tokens,
                # seconds in each startup phase (services/worker/startup.py) and from the first to ready
                "startup_s": startup.PROGRESS.durations(),
                "ready_s": round(startup.PROGRESS.state().started_s, 2),
                "compiles": compile_stats.STATS.summary(),  # Triton's, per phase (services/worker/compile_stats.py)
            }
        ),
        flush=True,
    )
    startup.PROGRESS.ready()
    await stop.wait()
    print(json.dumps({"event": "draining"}), flush=True)
    await server.stop()
    stopped = {"pools": dataclasses.asdict(server.engine.stats()), "compiles": compile_stats.STATS.summary()}
    print(json.dumps({"event": "stopped", **stopped}), flush=True)
    return 0


def _run(args: argparse.Namespace) -> int:
    import logging

    from services.entrypoints.cli import UsageError

    if args.data_parallel_size < 1:
        raise UsageError("--dp must be at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return asyncio.run(_serve(args))
    except ValueError as err:
        raise UsageError(str(err)) from err
    except (OSError, RuntimeError) as err:  # a port in use: bind errors from uvicorn's socket or grpc
        raise UsageError(f"cannot listen on {args.host} (HTTP {args.http_port}, gRPC {args.grpc_port}): {err}") from err
