"""The worker process: ``python -m services.entrypoints.worker --model tiny --grpc-addr 127.0.0.1:0``.

It builds (or loads) the model itself from the same ``--model`` and ``--model-seed`` as the engine, owns the
runner's pools (sized by the engine's rule, so both agree on the block count), serves ``worker.v1.Worker``
(services/worker/service.py) and grpc.health.v1, and prints one JSON ready line. With ``--dp N`` it is one
rank's worker: the torch MoE over its share of the routed experts.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from concurrent import futures

import grpc
import prometheus_client as prom
import torch
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from observability import tracing
from services import service_auth
from services.engine.config import EngineConfig
from services.engine.config_flags import add_parallel_arguments
from services.engine.device import add_device_arguments, device_args, device_engine_args
from services.engine.model_source import load_model
from services.grpc_errors import NoInternalText
from services.proto.worker.v1 import worker_pb2_grpc
from services.worker import compile_stats, startup
from services.worker.build import build_worker
from services.worker.parallel.groups import init_rank_groups
from services.worker.parallel.rank_experts import shard_over_group
from services.worker.service import MAX_MESSAGE_BYTES, SERVICE, WorkerApi, model_hashes

DESCRIPTION = "The worker as its own process: worker.v1.Worker over gRPC around the in-process Worker."


def main(argv: list[str] | None = None) -> int:
    from services import cache_dirs

    cache_dirs.setup()  # the compile caches, unless the environment names them (services/cache_dirs.py)
    compile_stats.install()
    p = argparse.ArgumentParser(prog="python -m services.entrypoints.worker", description=DESCRIPTION)
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset name")
    p.add_argument("--model-seed", type=int, default=0, help="a preset's weight seed (the engine's too)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the engine's; sizes the pools")
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
    p.add_argument("--grpc-addr", default="127.0.0.1:0", help="bind address (port 0: any)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0: any; default: none)")
    add_device_arguments(p)
    add_parallel_arguments(p)
    p.add_argument("--dp-rank", type=int, default=0, help="this worker's rank in its data-parallel group")
    p.add_argument(
        "--dp-rendezvous",
        default=None,
        help="tcp://host:port where the group's workers meet (rank 0 listens there; not the engines' "
        "rendezvous); needed with --dp > 1",
    )
    args = p.parse_args(argv)
    engine_args = {
        k: v for k, v in (("max_num_seqs", args.max_num_seqs), ("max_model_len", args.max_model_len)) if v is not None
    }
    tracing.setup("shinkai-worker")
    # The worker owns the device. Its pools follow the engine's sizing rule, so the engine's scheduler and
    # these pools agree on the block count; gpu_memory_utilization is then a cap it checks, not a size.
    ranks = args.data_parallel_size > 1
    if ranks and not (args.dp_rendezvous or "").startswith("tcp://"):
        raise SystemExit(
            f"--dp {args.data_parallel_size} needs --dp-rendezvous tcp://host:port, got {args.dp_rendezvous!r}"
        )
    if ranks:  # a rank's worker runs the torch MoE, as an in-process rank does (docs/parallelism.md)
        engine_args.update(
            kernel_backend=None,
            cuda_graphs=False,
            data_parallel_size=args.data_parallel_size,
            num_redundant_experts=args.num_redundant_experts,
        )
    config = EngineConfig(
        model_seed=args.model_seed,
        batch_invariant=args.batch_invariant,
        engram_on_host=args.engram_on_host,
        **device_engine_args({**engine_args, **device_args(args)}),
    )
    if ranks and str(config.device).startswith("cuda"):
        config = config.replace(device=f"cuda:{args.dp_rank}")  # rank r on cuda:r (NCCL: one rank per GPU)
        torch.cuda.set_device(config.device)
    if str(config.device).startswith("cuda") and config.kernel_backend is not None:
        from services.engine.llm import plan_memory
        from services.engine.memory_plan import NotEnoughMemory

        try:  # the device's memory planned before any byte is loaded (services/engine/memory_plan.py)
            plan_memory(args.model, config)
        except NotEnoughMemory as e:
            print(f"shinkai worker: {e}", file=sys.stderr)
            return 2
    # Until the worker is built its port answers NOT_SERVING with the startup phase (services/worker/startup.py).
    from services.gateway.startup_server import StartupServerThread

    host, asked_port = args.grpc_addr.rsplit(":", 1)
    starting = StartupServerThread(startup.PROGRESS, host, int(asked_port))
    bound_port = starting.start()
    try:
        with startup.phase("loading"):
            source = load_model(
                args.model,
                seed=args.model_seed,
                device=config.device or "cpu",
                load_format=config.load_format,
                precision=config.kernel_backend,
                expert_format=config.expert_format,
                engram_on_host=config.engram_on_host,
            )
        hashes, parallel, worker = _build(args, config, source, ranks)
    finally:
        starting.stop()
    return _serve(args, source, hashes, parallel, worker, f"{host}:{bound_port}")


def _build(args: argparse.Namespace, config: EngineConfig, source, ranks: bool) -> tuple:
    """(the model's hashes, this rank's expert parallelism or None, the worker) on ``source``."""
    hashes = model_hashes(source)  # the whole model's, before any sharding: what the engine compares
    parallel = None
    if ranks:  # this rank's experts only, exchanging tokens with the group's other workers
        groups = init_rank_groups(
            args.dp_rank, args.data_parallel_size, args.dp_rendezvous, str(config.device), config.rank_timeout_s
        )
        parallel = shard_over_group(
            source.model, groups, args.num_redundant_experts, str(config.device), config.worker_config()
        )
    worker = build_worker(source.model, config.worker_config(), expert_parallel=parallel)
    if str(config.device).startswith("cuda"):  # the engine's pool rule must fit the memory this worker may hold
        total = torch.cuda.get_device_properties(config.device).total_memory
        if torch.cuda.memory_reserved(config.device) > total * config.gpu_memory_utilization:
            raise SystemExit(
                f"model, pools and graphs hold {torch.cuda.memory_reserved(config.device) / 2**30:.1f} "
                f"GiB, over --gpu-memory-utilization {config.gpu_memory_utilization} of "
                f"{total / 2**30:.1f} GiB: lower --max-num-seqs or --max-model-len"
            )
    return hashes, parallel, worker


def _serve(args: argparse.Namespace, source, hashes, parallel, worker, address: str) -> int:
    """Serves worker.v1 and grpc.health on ``address`` (the port the startup server held) until SIGTERM."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4),
        options=[
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ],
        interceptors=[*service_auth.sync_server_interceptors(), NoInternalText()],  # the stack's service credential
    )
    api = WorkerApi(worker, args.model, hashes, source.config.vocab_size)
    worker_pb2_grpc.add_WorkerServicer_to_server(api, server)
    metrics_port = None
    if args.metrics_port is not None:
        http, _ = prom.start_http_server(
            args.metrics_port, addr=args.grpc_addr.rsplit(":", 1)[0], registry=api.registry
        )
        metrics_port = http.server_port
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(address)
    server.start()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    startup.PROGRESS.ready()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    # With --dp: this worker's rank and the routed experts its slots hold in the first MoE layer.
    group = (
        {"dp_rank": args.dp_rank, "experts": [int(e) for e in parallel.slots[0].local_experts]}
        if parallel is not None
        else {}
    )
    print(
        json.dumps(
            {
                "event": "ready",
                "service": "worker",
                "grpc_port": port,
                "metrics_port": metrics_port,
                "runner": type(worker.runner).__name__,
                "startup_s": startup.PROGRESS.durations(),  # seconds in each startup phase
                "compiles": compile_stats.STATS.summary(),  # Triton's, per phase (services/worker/compile_stats.py)
                **group,
            }
        ),
        flush=True,
    )
    stop.wait()
    for name in ("", SERVICE):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    server.stop(grace=5.0).wait()
    stopped = {"service": "worker", "compiles": compile_stats.STATS.summary()}  # "after_ready": steps waited on
    print(json.dumps({"event": "stopped", **stopped}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
