"""The one list of Shinkai's services: `services(config)` is the only place that says which processes make the
stack, in start order, with their command lines, health ports and what each needs healthy before it starts
(``after``). `shinkai up` (services/entrypoints/stack.py) starts them as local processes, each as soon as those
are healthy, so services that need nothing of each other load side by side; services/entrypoints/compose.py and
kubernetes.py render them as containers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.entrypoints.placement import LocalPlacement, Placement
from services.entrypoints.stack_config import StackConfig
from services.gateway.admission import admission_argv
from services.gateway.http_timeouts import http_timeout_argv


@dataclass(frozen=True)
class Service:
    name: str  # unique; also the log file's name
    argv: list[str]  # the command line
    health: str  # "grpc:<port>" (grpc.health.v1 SERVING) or "tcp:<port>" (accepts connections)
    url: str | None = None  # what `up` prints for people, if anything
    group: str | None = None  # services started and stopped together (a data-parallel group's ranks); None: alone
    # The services that must be healthy before this one starts (what it connects to while it starts); every other
    # service starts at once beside it.
    after: tuple[str, ...] = ()
    # Services this one waits for by itself once started: it becomes healthy only after them, so `up` counts its
    # --timeout from when they are healthy (its own start overlaps theirs).
    waits_for: tuple[str, ...] = ()


def _model_config(model: str):
    """The ModelConfig of a preset name or checkpoint directory (its config.json only)."""
    from model.deepseek_v41.presets import PRESETS, preset

    if model in PRESETS:
        return preset(model)
    from model.deepseek_v41.config import load_config

    return load_config(Path(model))


def _rank_argv(config: StackConfig, rank: int, rendezvous: str) -> list[str]:
    """Rank ``rank``'s place in the stack's data-parallel group (engines' or remote workers'), meeting at
    ``rendezvous`` (host:port of rank 0)."""
    return [
        "--dp",
        str(config.data_parallel_size),
        "--num-redundant-experts",
        str(config.num_redundant_experts),
        "--dp-rank",
        str(rank),
        "--dp-rendezvous",
        f"tcp://{rendezvous}",
    ]


def services(config: StackConfig, placement: Placement | None = None) -> list[Service]:
    """Every service of the stack, in start order. ``placement`` says where each one listens and is reached
    (default: `LocalPlacement.for_config`; `services/entrypoints/compose.py` passes its container placement)."""
    at = placement or LocalPlacement.for_config(config)
    nats_url = f"nats://{at.reach('nats', 'client')}"
    py = at.python
    cfg = _model_config(config.model)
    num_experts, num_layers = cfg.n_routed_experts, cfg.num_hidden_layers  # for the EPLB planner

    def bind(name: str, what: str) -> str:
        return f"{at.bind_host(name)}:{at.port(name, what)}"

    stack = [
        Service("nats", at.nats_command(), f"tcp:{at.port('nats', 'client')}", nats_url),
        Service(
            "tokenizer",
            [
                *py,
                "services.entrypoints.tokenizer",
                "--model",
                config.model,
                "--grpc-addr",
                bind("tokenizer", "grpc"),
                "--metrics-port",
                str(at.port("tokenizer", "metrics")),
            ],
            f"grpc:{at.port('tokenizer', 'grpc')}",
            f"metrics http://{at.reach('tokenizer', 'metrics')}/metrics",
        ),
    ]
    ranks = config.data_parallel_size > 1
    if cfg.vision is not None:  # the vision tower's own process
        stack.append(
            Service(
                "multimodal",
                [
                    *py,
                    "services.entrypoints.multimodal",
                    "--model",
                    config.model,
                    "--grpc-addr",
                    bind("multimodal", "grpc"),
                    "--metrics-port",
                    str(at.port("multimodal", "metrics")),
                ],
                f"grpc:{at.port('multimodal', 'grpc')}",
                f"metrics http://{at.reach('multimodal', 'metrics')}/metrics",
            )
        )
    num_engines = config.data_parallel_size if ranks else config.num_engines  # engine processes
    stack += [
        Service(
            "eplb",
            [
                *py,
                "services.entrypoints.eplb",
                "--nats-url",
                nats_url,
                "--health-addr",
                bind("eplb", "grpc"),
                "--num-experts",
                str(num_experts),  # a group's ranks apply its plans live
                "--num-gpus",
                str(config.data_parallel_size if ranks else 1),
                "--num-redundant",
                str(config.num_redundant_experts if ranks else 0),
                "--num-layers",
                str(num_layers),
                "--num-ranks",
                str(num_engines),
            ],
            f"grpc:{at.port('eplb', 'grpc')}",
            after=("nats",),  # it subscribes at start
        ),  # its --metrics-port binds every interface: left off
    ]
    engines = []
    sizing = ["--max-num-seqs", str(config.max_num_seqs)] if config.max_num_seqs is not None else []
    sizing += ["--max-model-len", str(config.max_model_len)] if config.max_model_len is not None else []
    sizing += ["--batch-invariant"] if config.batch_invariant else []
    sizing += ["--engram-on-host"] if config.engram_on_host else []
    spec = (
        ["--num-speculative-tokens", str(config.num_speculative_tokens), "--spec-sampling", config.spec_sampling]
        if config.num_speculative_tokens
        else []
    )  # the engine's (in-process worker)
    spec += ["--spec-varlen"] if config.num_speculative_tokens and config.spec_varlen else []
    from services.engine.config_flags import step_argv

    spec += step_argv(dict(config.step_args))  # the engine's: its scheduler plans the steps
    from services.engine.device import device_argv

    device = device_argv(dict(config.device_args))  # the engine's, or its remote worker's (the device's owner)
    drain = ["--drain-timeout", str(config.drain_timeout_s)] if config.drain_timeout_s is not None else []
    if ranks and config.num_engines != 1:
        raise ValueError("a data-parallel group is the stack's one engine: with --dp > 1 leave --num-engines at 1")
    # A group's worker processes start together before its engines (the workers meet at worker-0's rendezvous
    # for the exchange, and each engine connects to its worker); the engines meet at engine-0's for the votes.
    group_workers: list[Service] = []
    group_engines: list[Service] = []
    for i in range(num_engines):
        name, worker = f"engine-{i}", f"worker-{i}"
        engines.append(f"{name}={at.reach(name, 'grpc')}")
        # Each rank is an engine endpoint of its own (the gateway routes over them by load); rank 0 hosts the
        # group's rendezvous (services/engine/parallel/served_rank.py).
        group = _rank_argv(config, i, at.reach("engine-0", "rendezvous")) if ranks else []
        argv = [
            *py,
            "services.entrypoints.engine",
            "--model",
            config.model,
            "--replica",
            name,
            "--rank",
            str(i),
            *group,
            "--host",
            at.bind_host(name),
            "--grpc-port",
            str(at.port(name, "grpc")),
            "--metrics-port",
            str(at.port(name, "metrics")),
            "--nats-url",
            nats_url,
            *sizing,
            *spec,
            *drain,
            *(
                device_argv({k: v for k, v in config.device_args if k == "load_format"})
                if config.remote_workers
                else device
            ),
        ]
        if cfg.vision is not None:  # encoded here; a remote worker takes the rows by SetImages
            argv += ["--multimodal", at.reach("multimodal", "grpc")]
        if config.remote_workers:
            worker_group = _rank_argv(config, i, at.reach("worker-0", "rendezvous")) if ranks else []
            service = Service(
                worker,
                [
                    *py,
                    "services.entrypoints.worker",
                    "--model",
                    config.model,
                    "--grpc-addr",
                    bind(worker, "grpc"),
                    "--metrics-port",
                    str(at.port(worker, "metrics")),
                    *sizing,
                    *device,
                    *worker_group,
                ],
                f"grpc:{at.port(worker, 'grpc')}",
                f"metrics http://{at.reach(worker, 'metrics')}/metrics",
                "worker-ranks" if ranks else None,
            )
            if ranks:
                group_workers.append(service)
            else:
                stack.append(service)
            argv += ["--worker", at.reach(worker, "grpc")]
        engine = Service(
            name,
            argv,
            f"grpc:{at.port(name, 'grpc')}",
            f"metrics http://{at.reach(name, 'metrics')}/metrics",
            "ranks" if ranks else None,
            # NATS for its reports; its own worker process, which it drives from the start. The multimodal
            # service is reached per request (an engine serves text without it).
            after=("nats", *([worker] if config.remote_workers else [])),
        )
        if ranks:
            group_engines.append(engine)
        else:
            stack.append(engine)
    stack += group_workers + group_engines
    gateway = [
        *py,
        "services.entrypoints.gateway",
        "--tokenizer",
        at.reach("tokenizer", "grpc"),
        "--nats-url",
        nats_url,
        "--host",
        at.bind_host("gateway"),
        "--http-port",
        str(at.port("gateway", "http")),
        "--grpc-port",
        str(at.port("gateway", "grpc")),
        *drain,
        *(["--allow-private-image-urls"] if config.allow_private_image_urls else []),
        *http_timeout_argv(config.http_timeouts),
        *admission_argv(config.admission),
    ]
    for spec in engines:
        gateway += ["--engine", spec]
    stack.append(
        Service(
            "gateway",
            gateway,
            f"grpc:{at.port('gateway', 'grpc')}",
            f"http://{at.reach('gateway', 'http')}/v1 and grpc {at.reach('gateway', 'grpc')}",
            after=("nats",),  # it subscribes to the engines' reports at start
            # It waits for an engine to read the model from, and is healthy only with the tokenizer and an engine.
            waits_for=("tokenizer", *(spec.split("=", 1)[0] for spec in engines)),
        )
    )
    return stack
