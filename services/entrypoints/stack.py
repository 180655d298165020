"""The local launcher behind `shinkai up` / `shinkai down`.

`up` starts each service of the one list (`services()`, services/entrypoints/service_list.py) as its own
process (its own session, its log in ``<run_dir>/logs/<name>.log``) as soon as the services it needs
(``Service.after``) are healthy, so services that need nothing of each other load side by side (one that waits
for others by itself, ``Service.waits_for``, gets its ``timeout_s`` from when they are healthy); it probes each
starting one every ``POLL_S`` until all are healthy (a line per service: its seconds from its start and from
`up`'s), records every PID in ``<run_dir>/stack.json`` in start order, and last starts the supervisor
(services/entrypoints/supervisor.py), which restarts a crashed service and from then on keeps stack.json. Each
process gets only its own secrets in its environment (services/entrypoints/credentials.py). `down` stops the
supervisor, then sends SIGTERM in reverse order (each service drains), waits, and only then SIGKILLs what is
left. A PID is signalled only while /proc says it still runs the recorded command.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from services import nats_auth
from services.entrypoints.credentials import NATS, StackCredentials, without_secrets
from services.entrypoints.invocation import shinkai_command
from services.entrypoints.probe import alive_as, health_state
from services.entrypoints.service_list import Service, services
from services.entrypoints.stack_config import StackConfig
from services.gateway.auth import KEY_ENV
from services.ports import free_port
from services.worker.startup import StartupState

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.05  # between two rounds of health probes of the services still starting


def _state_path(run_dir: Path) -> Path:
    return run_dir / "stack.json"


def write_state(run_dir: Path, state: dict) -> None:
    """Replaces stack.json whole (a reader never sees half a file)."""
    path = _state_path(run_dir)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(state, indent=1))
    os.replace(partial, path)


def _recorded(state: dict) -> list[dict]:
    """Every process a stack.json records: the services and the supervisor."""
    return [*state["services"], *([state["supervisor"]] if state.get("supervisor") else [])]


def stack_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment every service starts with: the caller's less its secrets (each process adds its own), the
    project on PYTHONPATH, and gRPC's core logging errors only unless ``GRPC_VERBOSITY`` says otherwise (its info
    lines, a peer's GOAWAY say, would sit among a service's own lines in its log)."""
    env = without_secrets(environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environ.get("PYTHONPATH")]))
    env.setdefault("GRPC_VERBOSITY", "ERROR")
    return env


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
    env = stack_environment(os.environ)
    nats_config = nats_auth.write_config(config.run_dir / "nats.conf", credentials.nats_users)

    def start(service: Service) -> _Starting:
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
        return _Starting(service, proc, log_path, StartupLines(service.name, log), time.monotonic() + timeout_s)

    waiting = _batches(stack)  # a group's members start together: they wait for each other
    starting: list[_Starting] = []
    healthy: set[str] = set()
    began = time.monotonic()
    while waiting or starting:
        for batch in [b for b in waiting if all(set(s.after) <= healthy for s in b)]:  # in list order
            waiting.remove(batch)
            starting += [start(service) for service in batch]
        if not starting:  # what is left waits for services that are not in the list
            down(config.run_dir, log=lambda *_: None)
            raise RuntimeError(f"{', '.join(s.name for b in waiting for s in b)} wait for services not in the stack")
        for s in list(starting):
            serving, progress = health_state(config.host, s.service.health)
            if serving:
                starting.remove(s)
                healthy.add(s.service.name)
                took = f"in {time.monotonic() - s.started_at:.1f} s, at {time.monotonic() - began:.1f} s"
                url = f"  {s.service.url}" if s.service.url else ""
                log(f"{s.service.name:<10} pid {s.proc.pid:<7} healthy {took}{url}")
                continue
            if progress is not None and s.shown.show(progress):  # a starting engine that moves on gets
                s.deadline = max(s.deadline, time.monotonic() + timeout_s)  # timeout_s from its latest step
            if not set(s.service.waits_for) <= healthy:  # its clock starts once what it waits for is healthy
                s.deadline = time.monotonic() + timeout_s
            if s.proc.poll() is not None or time.monotonic() > s.deadline:
                late = "no startup progress" if s.shown.progressed else "not healthy"
                why = f"exited with {s.proc.returncode}" if s.proc.poll() is not None else f"{late} in {timeout_s} s"
                down(config.run_dir, log=lambda *_: None)
                raise RuntimeError(f"{s.service.name} {why}; see {s.log_path}{_last_error(s.log_path)}")
        if starting:
            time.sleep(POLL_S)
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


@dataclass
class _Starting:
    """A started service that is not healthy yet."""

    service: Service
    proc: subprocess.Popen
    log_path: Path
    shown: StartupLines
    deadline: float  # monotonic; moved on by a starting engine's progress
    started_at: float = field(default_factory=time.monotonic)


class StartupLines:
    """`up`'s progress lines for one starting engine: a line when its phase or its count of steps changes, and every
    ``every_s`` seconds within a long phase ("engine-0   capturing [####------] 4/11 (8 rows) 52 s")."""

    def __init__(self, name: str, log, every_s: float = 15.0) -> None:
        self.name = name
        self.log = log
        self.every_s = every_s
        self.progressed = False  # its phase or step count has changed at least once
        self._last: tuple | None = None
        self._at = 0.0

    def show(self, state: StartupState) -> bool:
        """Prints a line where due; True when the phase or its count of steps changed since the last state."""
        key = (state.phase, state.done)
        moved = key != self._last
        if not moved and time.monotonic() - self._at < self.every_s:
            return False
        self.progressed |= moved
        self._last, self._at = key, time.monotonic()
        self.log(f"{self.name:<10} {state.describe(bar_width=20)}  ({state.started_s:.0f} s since start)")
        return moved


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
