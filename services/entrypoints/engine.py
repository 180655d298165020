"""One engine replica as its own process (a service of `shinkai up`).

It serves ``shinkai.v1.Shinkai`` over gRPC for the gateway (token ids in, token ids out; no text: the
tokenizer service detokenizes), grpc.health.v1, and publishes load reports and lifecycle events on NATS, and,
when its engine has a prefix cache (``Engine.take_kv_events``), the blocks entering and leaving it
(`services/engine/reporting/kv_events_publisher.py`) for the gateways' cache-aware routing.
The worker runs in-process, or in its own process with ``--worker ADDR``; with NATS, every step's
expert counts also go to the EPLB planner (`services/engine/reporting/expert_loads.py`); a data-parallel rank also
takes the planner's plans and applies them live (`services/engine/parallel/live_plans.py`). SIGTERM drains: "draining"
on NATS and NOT_SERVING, live requests get ``--drain-timeout`` seconds, then "down" and exit 0 with whole pools.

A remote worker is watched by heartbeat (`services/engine/remote/heartbeat.py`): while it is gone the engine is
NOT_SERVING, refuses new requests (UNAVAILABLE) and announces "unhealthy" on NATS, and the requests it held
end with "error"; once the worker answers again and serves the same model, "up" and SERVING again.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time

PROCESS_START = time.monotonic()  # this module is the process's first import: its start, for the ready event
log = logging.getLogger("shinkai.engine.process")
DEFAULT_REPLICA = "engine-0"


class EngineEndpoint:
    """One engine's shinkai.v1 gRPC endpoint (no HTTP, token ids only) for a gateway: the `ServedEngine`
    behind the API's frontend, which takes the gateway's request ids. ``stop()`` drains as `shinkai serve`
    does (`ServedEngine.stop`)."""

    def __init__(
        self,
        llm,
        *,
        replica: str,
        host: str,
        grpc_port: int,
        drain_timeout_s: float,
        served_model_name: str,
        image_encoder=None,
    ) -> None:
        from services import service_auth
        from services.engine.served_engine import ServedEngine
        from services.gateway.api_server import ApiServer
        from services.gateway.backends import LocalEngine, LocalTokenizer
        from services.gateway.frontend import Frontend

        self.llm = llm
        self.drain_timeout_s = drain_timeout_s
        self.served = ServedEngine(
            llm, served_model_name=served_model_name, replica=replica, image_encoder=image_encoder
        )
        self.engine = self.served.service
        self.metrics = self.served.metrics
        frontend = Frontend(
            self.served.info,
            LocalEngine(self.engine, self.served.images),
            LocalTokenizer(llm, self.served.chat, detokenize=False),
            self.metrics,
            takes_request_ids=True,
        )
        # A gateway forwards a chat's images as bytes: up to max_images of max_bytes each, with the prompt.
        limits = self.served.images.limits
        self.api = ApiServer(
            frontend,
            host,
            None,
            grpc_port,
            max_receive_bytes=limits.max_images * limits.max_bytes + 16 * 2**20,
            interceptors=service_auth.server_interceptors(),  # only the stack's services may call it
        )

    async def start(self) -> None:
        await self.served.start(self.api)

    async def stop(self) -> None:
        await self.served.stop(self.api, self.drain_timeout_s)


SETTLE_S = 1.0
"""A lost worker counts as back once its heartbeat has been answered, without a miss, for this long (two checks
at the default interval) and it still serves the engine's model: one answer from a worker that is catching up
after a stall does not flip health back and forth."""


async def watch_worker(remote, source, api, reporter, interval_s: float = 0.1, settle_s: float = SETTLE_S) -> None:
    """Keeps health and lifecycle in step with the worker's heartbeat (runs until cancelled)."""
    lost = False
    while True:
        await asyncio.sleep(interval_s)
        if remote.alive != lost:
            continue  # no change
        if lost:
            if remote.answering_for() < settle_s:
                continue  # answering again, not yet steadily
            try:  # a restarted worker must still serve the engine's model
                await asyncio.to_thread(remote.check_model, source, 10.0)
            except Exception as err:
                log.error("worker %s is back but refused: %s", remote.address, err)
                await asyncio.sleep(1.0)
                continue
            if remote.answering_for() < settle_s:
                continue  # it missed a check meanwhile
        lost = not lost
        log.warning("worker %s %s", remote.address, "lost: not serving" if lost else "back: serving again")
        await api.set_problem(f"the worker at {remote.address} is not answering" if lost else None)
        if reporter is not None:
            await reporter.lifecycle("unhealthy" if lost else "up")


async def watch_group(service, api, reporter, interval_s: float = 0.1, on_lost=None) -> None:
    """NOT_SERVING and "unhealthy" on NATS, for good, once this rank's data-parallel group is lost (runs until
    it is, or until cancelled); then ``on_lost()`` if given."""
    while service.group_failure is None:
        await asyncio.sleep(interval_s)
    log.error("data-parallel group lost: not serving: %s", service.group_failure)
    await api.set_problem(f"this engine's data-parallel group is lost: {service.group_failure}")
    if reporter is not None:
        await reporter.lifecycle("unhealthy")
    if on_lost is not None:
        on_lost()


def apply_launcher_place(args: argparse.Namespace, environ) -> bool:
    """With ``--dp-rendezvous env://`` (a rank started by torchrun, on any host of its group): the rank, the
    group's size, the device and the ports from the launcher's environment, in ``args``; True then. Each of
    a host's ranks takes ``--grpc-port`` (and ``--metrics-port``) plus its local rank, so one set of flags
    serves every process of the host."""
    if args.dp_rendezvous != "env://":
        return False
    from services.engine.device import default_device
    from services.engine.parallel.rank_place import from_launcher

    place = from_launcher(environ)
    given = [
        f"{flag} {value} (the launcher's {name}={actual})"
        for flag, value, unset, name, actual in (
            ("--dp", args.data_parallel_size, 1, "WORLD_SIZE", place.world_size),
            ("--dp-rank", args.dp_rank, 0, "RANK", place.rank),
        )
        if value not in (unset, actual)
    ]
    if given:
        raise ValueError(f"with --dp-rendezvous env:// the launcher places the rank; drop {', '.join(given)}")
    args.data_parallel_size, args.dp_rank, args.rank = place.world_size, place.rank, place.rank
    if args.replica == DEFAULT_REPLICA:
        args.replica = f"engine-{place.rank}"
    args.grpc_port = place.port(args.grpc_port)
    args.metrics_port = place.port(args.metrics_port)
    if not args.worker:  # a remote worker owns the device
        args.device = place.device(args.device or default_device())
    from services import nats_auth

    own = environ.get(nats_auth.password_env(args.replica))
    if own:  # a pod holding every rank's NATS password (deploy/kubernetes-multihost.yaml): this rank's own user
        environ[nats_auth.USER_ENV], environ[nats_auth.PASSWORD_ENV] = args.replica, own
    return True


async def run(args: argparse.Namespace) -> int:
    from observability import tracing

    # A launcher's rank (torchrun, docs/parallelism.md "More than one host") leaves once its group is lost, so
    # its launcher stops the host's other ranks and the whole group can be started again (Kubernetes restarts a
    # LeaderWorkerSet's group); a rank of `shinkai up` stays NOT_SERVING until `shinkai down`.
    launched = apply_launcher_place(args, os.environ)

    tracing.setup("shinkai-engine")
    from services.engine.llm import LLM
    from services.engine.reporting.reporter import LoadReporter
    from services.worker import compile_stats, startup

    compile_stats.install()
    engine_args = {
        k: v for k, v in (("max_num_seqs", args.max_num_seqs), ("max_model_len", args.max_model_len)) if v is not None
    }
    if args.batch_invariant:
        engine_args["batch_invariant"] = True
    if args.engram_on_host:
        engine_args["engram_on_host"] = True
    from services.engine.device import device_args

    given = device_args(args)
    if args.worker:  # a remote worker owns the device and the weights; only their identity matters here
        given = {k: v for k, v in given.items() if k == "load_format"}
    engine_args.update(given)
    from services.engine.config_flags import speculative_args, step_args

    engine_args.update(speculative_args(args))
    engine_args.update(step_args(args))
    from services.engine.config_flags import parallel_args

    remote = None

    def build_llm() -> LLM:  # off the event loop, while the startup server answers probes
        nonlocal remote
        if parallel_args(args):  # one rank of a data-parallel group (services/engine/parallel/served_rank.py)
            from services.engine.parallel.served_rank import start_rank

            if args.worker:  # the rank's worker process: it joined the workers' group for the exchange
                from services.engine.remote.remote_worker import RemoteWorker

                remote = RemoteWorker(args.worker)
            llm = start_rank(
                args.model, args.dp_rank, args.dp_rendezvous or "", {**engine_args, **parallel_args(args)}, remote
            )
            if remote is not None:
                remote.check_model(llm.source)  # refuses a worker serving another model; starts its heartbeat
            return llm
        if args.worker:
            from services.engine.remote.remote_worker import RemoteWorker

            remote = RemoteWorker(args.worker)
            llm = LLM(model=args.model, worker=remote, **engine_args)
            remote.check_model(llm.source)  # refuses a worker serving another model; starts its heartbeat
            return llm
        return LLM(model=args.model, **engine_args)

    # Until the engine is built its port answers NOT_SERVING with the startup phase (services/worker/startup.py),
    # then the endpoint takes the same port over.
    from services.gateway.startup_server import StartupServer

    starting = StartupServer(startup.PROGRESS, args.host, args.grpc_port)
    await starting.start()
    try:
        llm = await asyncio.to_thread(build_llm)
    finally:
        await starting.stop()
    args.grpc_port = starting.grpc_port
    image_encoder = None
    if args.multimodal:
        from services.engine.images.encoder import MultimodalClient

        image_encoder = MultimodalClient(args.multimodal)
    server = EngineEndpoint(
        llm,
        replica=args.replica,
        host=args.host,
        grpc_port=args.grpc_port,
        drain_timeout_s=args.drain_timeout,
        served_model_name=args.served_model_name or args.model,
        image_encoder=image_encoder,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    publisher = None
    if args.nats_url:  # wrap the worker before the server takes requests
        from services.engine.reporting.expert_loads import ExpertLoadPublisher

        report = None
        if args.data_parallel_size > 1 and llm.rank is not None:  # the receiving side's slot counts, under the
            # plan version in force
            from services.engine.parallel.live_plans import slot_load_report

            rank = llm.rank
            report = lambda step: slot_load_report(rank.parallel, rank.rank, step, rank.live.version)  # noqa: E731
        publisher = ExpertLoadPublisher(server.llm.engine.worker, None, loop, args.rank, report, args.replica)
        server.llm.engine.worker = publisher
    await server.start()
    address = server.api.urls()["grpc"]
    metrics_port = None
    if args.metrics_port is not None:
        import prometheus_client as prom

        http, _ = prom.start_http_server(args.metrics_port, addr=args.host, registry=server.metrics.registry)
        metrics_port = http.server_port
    reporter = None
    if args.nats_url:
        reporter = LoadReporter(args.nats_url, args.replica, address, server.engine.stats)
        await reporter.start()
    if publisher is not None and reporter is not None:
        publisher.nc = reporter.nc  # expert-load reports start with the next step
    kv_events = None
    # An engine with a prefix cache: its cached blocks, for the gateways' cache-aware routing (taken from the
    # service, which the step thread keeps up to date: only that thread touches the engine).
    take = server.engine.take_kv_events if server.llm.engine.prefix_cache_enabled else None
    if reporter is not None and take is not None:
        from services.engine.reporting.kv_events_publisher import KvEventsPublisher

        kv_events = KvEventsPublisher(reporter.nc, args.replica, take, interval_s=reporter.interval_s)
        kv_events.start()
    if reporter is not None and args.data_parallel_size > 1 and llm.rank is not None:  # the planner's plans,
        # applied live (with a worker process the weights are there: not built, docs/parallelism.md)
        from services.engine.parallel.live_plans import PlanIntake

        await PlanIntake(llm.rank.live).subscribe(reporter.nc)
    worker = publisher.worker if publisher is not None else server.llm.engine.worker
    runner = f"remote worker {args.worker}" if args.worker else type(worker.runner).__name__
    print(
        json.dumps(
            {
                "event": "ready",
                "service": "engine",
                "replica": args.replica,
                "pid": os.getpid(),
                "dp_rank": args.dp_rank if args.data_parallel_size > 1 else None,
                "grpc": address,
                "grpc_port": server.api.grpc_port,
                "metrics_port": metrics_port,
                "runner": runner,
                "scheduling": server.llm.config.scheduling,
                "max_num_batched_tokens": server.llm.config.max_num_batched_tokens,
                # seconds in each startup phase (services/worker/startup.py) and from the first to ready
                "startup_s": startup.PROGRESS.durations(),
                "ready_s": round(startup.PROGRESS.state().started_s, 2),
                "process_s": round(time.monotonic() - PROCESS_START, 2),  # from the process's start to ready
                "compiles": compile_stats.STATS.summary(),  # Triton's, per phase (services/worker/compile_stats.py)
            }
        ),
        flush=True,
    )
    startup.PROGRESS.ready()
    watch = None
    if args.data_parallel_size > 1:  # a rank's lost worker fails its next step, which loses the group for good
        watch = asyncio.create_task(
            watch_group(server.engine, server.api, reporter, on_lost=stop.set if launched else None)
        )
    elif args.worker:
        watch = asyncio.create_task(watch_worker(remote, server.llm.source, server.api, reporter))
    await stop.wait()
    if watch is not None:
        watch.cancel()
    await server.api.close_intake()  # NOT_SERVING before "draining": a gateway's health poll agrees with it
    if reporter is not None:
        await reporter.lifecycle("draining")
    await server.stop()
    if kv_events is not None:
        await kv_events.stop()
    if reporter is not None:
        await reporter.stop()
    print(
        json.dumps(
            {
                "event": "stopped",
                "service": "engine",
                "pools": dataclasses.asdict(server.engine.stats()),
                "compiles": compile_stats.STATS.summary(),  # "after_ready": what requests waited on
            }
        ),
        flush=True,
    )
    return 1 if launched and server.engine.group_failure is not None else 0


def parser() -> argparse.ArgumentParser:
    """The engine process's flags."""
    p = argparse.ArgumentParser(prog="python -m services.entrypoints.engine", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset name")
    p.add_argument("--served-model-name", default=None)
    p.add_argument(
        "--replica",
        default=DEFAULT_REPLICA,
        help="this engine instance's name in loads, reports, metrics (with --dp-rendezvous env://: engine-<rank>)",
    )
    p.add_argument("--rank", type=int, default=0, help="this engine's rank in expert-load reports")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--grpc-port", type=int, default=0, help="0: any free port")
    p.add_argument("--nats-url", default=None, help="publish load reports and lifecycle events here")
    p.add_argument("--worker", default=None, help="host:port of a worker process (default: in-process)")
    p.add_argument(
        "--multimodal",
        default=None,
        help="host:port of the multimodal service that encodes images (default: the model's own tower in this process)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
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
    p.add_argument("--drain-timeout", type=float, default=30.0)
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0: any; default: none)")
    from services.engine.config_flags import add_parallel_arguments, add_speculative_arguments, add_step_arguments
    from services.engine.device import add_device_arguments

    add_device_arguments(p)
    add_speculative_arguments(p)
    add_step_arguments(p)
    add_parallel_arguments(p)
    p.add_argument("--dp-rank", type=int, default=0, help="this engine's rank in its data-parallel group")
    p.add_argument(
        "--dp-rendezvous",
        default=None,
        help="tcp://host:port where the group's ranks meet (rank 0 listens there), needed with --dp > 1; or env:// "
        "for a rank started by torchrun on any host (its rank, --dp, device and port offset from the launcher)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    from services import cache_dirs

    cache_dirs.setup()  # the compile caches, unless the environment names them (services/cache_dirs.py)
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from services.engine.memory_plan import NotEnoughMemory

    try:
        return asyncio.run(run(args))
    except NotEnoughMemory as e:  # the model does not fit the device: one line saying why and what helps
        log.error("%s", e)
        print(f"shinkai engine: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
