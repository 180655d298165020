"""The supervisor of a `shinkai up` stack: one detached process that restarts a crashed service.

`up` starts it last (`python -m services.entrypoints.supervisor --run-dir DIR`, each service's secret
variables on its stdin, held in memory only: never its command line or environment); it records itself under
``"supervisor"`` in ``<run_dir>/stack.json`` and from then on owns that file. `down` stops it before any
service. Every ``interval_s`` it checks each recorded service's PID (`probe.alive_as`):

- A service that is gone has crashed (a kill, a fault, an exit of its own): logged, counted, and restarted
  with its recorded command and environment after a backoff (``backoff_s``, doubled with each crash in a
  row, at most ``max_backoff_s``). The new PID goes into stack.json at once.
- A restarted service counts as back once its health port answers (gRPC SERVING); once it has stayed up for
  ``reset_after_s`` its crashes in a row are forgotten.
- The crash after ``restart_limit`` restarts in a row is not restarted: the service's state is ``failed``,
  logged, and ``shinkai_supervisor_gave_up{service}`` is 1, until `down`.
- Restarted: every service that runs alone (nats-server, tokenizer, multimodal, EPLB planner, engines, their
  remote workers, the gateway), each with its own secrets only. Not restarted (a crash is reported as
  ``failed``): a data-parallel group's ranks (a rank cannot rejoin its group alone).

The gateway needs nothing from the supervisor: its health poll (services/gateway/engine_health.py) stops
routing to an engine that does not answer and routes to it again once it answers SERVING; the services'
gRPC channels and NATS clients reconnect to a restarted peer on their own.

Each event is one JSON line on stdout (``<run_dir>/logs/supervisor.log``); the metrics are on
``--metrics-port``; ``shinkai status`` prints each service's state from stack.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import prometheus_client as prom

import observability.metrics as names
from services.entrypoints.probe import alive_as, healthy
from services.entrypoints.stack import ROOT, write_state


@dataclass(frozen=True)
class Policy:
    restart_limit: int = 4  # restarts in a row; the crash after them is left down and reported
    backoff_s: float = 1.0  # wait before the first restart in a row; doubled for each one after it
    max_backoff_s: float = 30.0  # the longest wait before a restart
    reset_after_s: float = 60.0  # up this long after a restart: its crashes in a row are forgotten

    def backoff(self, crashes_in_row: int) -> float:
        return min(self.backoff_s * 2 ** max(crashes_in_row - 1, 0), self.max_backoff_s)


def restartable(entry: dict) -> bool:
    """A service that runs alone; a data-parallel group's rank cannot rejoin its group by itself."""
    return entry.get("group") is None


class Metrics:
    def __init__(self, registry: prom.CollectorRegistry) -> None:
        self.registry = registry
        self.crashes = prom.Counter(names.SUPERVISOR_CRASHES, "services found gone", ["service"], registry=registry)
        self.restarts = prom.Counter(
            names.SUPERVISOR_RESTARTS, "services started again", ["service"], registry=registry
        )
        self.gave_up = prom.Gauge(
            names.SUPERVISOR_GAVE_UP,
            "1: the service crashed past its restart limit and stays down",
            ["service"],
            registry=registry,
        )
        self.up = prom.Gauge(
            names.SUPERVISOR_SERVICE_UP, "1: the service runs and is healthy", ["service"], registry=registry
        )


class Supervisor:
    def __init__(
        self,
        run_dir: Path,
        host: str,
        policy: Policy,
        secrets: dict[str, dict[str, str]],
        metrics: Metrics,
        log=print,
    ) -> None:
        self.run_dir = run_dir
        self.host = host  # where the services' health ports listen
        self.policy = policy
        self.secrets = secrets  # service name → its secret variables (`StackCredentials.env_for`), in memory only
        self.metrics = metrics
        self.log = log  # takes one JSON line
        self.state = json.loads((run_dir / "stack.json").read_text())
        self.children: dict[str, subprocess.Popen] = {}  # restarted services (this process's children)
        self._restart_at: dict[str, float] = {}  # name → when its pending restart is due
        self._started_at: dict[str, float] = {}  # name → when its current process was started here
        self._up_since: dict[str, float] = {}  # name → when it last became healthy
        for entry in self.state["services"]:
            entry.update(state="running", restarts=0, crashes_in_row=0)
            self.metrics.up.labels(entry["name"]).set(1)
            self.metrics.gave_up.labels(entry["name"]).set(0)
            self._up_since[entry["name"]] = time.monotonic()

    def record_self(self, argv: list[str], metrics_port: int | None) -> None:
        log_path = self.run_dir / "logs" / "supervisor.log"
        self.state["supervisor"] = {
            "pid": os.getpid(),
            "argv": argv,
            "metrics_port": metrics_port,
            "log": str(log_path),
            "url": f"metrics http://{self.host}:{metrics_port}/metrics" if metrics_port else None,
            "policy": dataclasses.asdict(self.policy),
        }
        self._save()

    def _save(self) -> None:
        write_state(self.run_dir, self.state)

    def _event(self, event: str, entry: dict, **fields) -> None:
        self.log(json.dumps({"event": event, "service": entry["name"], "time": time.time(), **fields}))

    def _exit_code(self, name: str) -> int | None:
        child = self.children.get(name)
        return child.poll() if child is not None else None  # the first processes are `up`'s, not ours

    def tick(self) -> None:
        """One round over every service."""
        now = time.monotonic()
        changed = False
        for entry in self.state["services"]:
            name, state = entry["name"], entry["state"]
            if state in ("running", "starting") and not alive_as(entry["pid"], entry["argv"]):
                changed |= self._crashed(entry, now)
            elif state == "starting" and healthy(self.host, entry["health"]):
                entry["state"] = "running"
                self._up_since[name] = now
                self.metrics.up.labels(name).set(1)
                self._event("healthy", entry, pid=entry["pid"], after_s=round(now - self._started_at[name], 2))
                changed = True
            elif (
                state == "running"
                and entry["crashes_in_row"]
                and now - self._up_since[name] >= self.policy.reset_after_s
            ):
                entry["crashes_in_row"] = 0
                changed = True
            elif state == "waiting" and now >= self._restart_at[name]:
                self._restart(entry, now)
                changed = True
        if changed:
            self._save()

    def _crashed(self, entry: dict, now: float) -> bool:
        name = entry["name"]
        entry["crashes_in_row"] += 1
        self.metrics.crashes.labels(name).inc()
        self.metrics.up.labels(name).set(0)
        code = self._exit_code(name)
        if not restartable(entry) or entry["crashes_in_row"] > self.policy.restart_limit:
            entry["state"] = "failed"
            self.metrics.gave_up.labels(name).set(1)
            why = "not restarted by the supervisor" if not restartable(entry) else "restart limit reached"
            self._event("gave_up", entry, pid=entry["pid"], exit_code=code, why=why, restarts=entry["restarts"])
            return True
        delay = self.policy.backoff(entry["crashes_in_row"])
        entry["state"] = "waiting"
        self._restart_at[name] = now + delay
        self._event(
            "crashed",
            entry,
            pid=entry["pid"],
            exit_code=code,
            crashes_in_row=entry["crashes_in_row"],
            restart_in_s=delay,
        )
        return True

    def _restart(self, entry: dict, now: float) -> None:
        name = entry["name"]
        env = dict(os.environ, **self.secrets.get(name, {}))
        with open(entry["log"], "ab") as out:
            proc = subprocess.Popen(
                entry["argv"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.children[name] = proc
        entry.update(pid=proc.pid, state="starting", restarts=entry["restarts"] + 1)
        self._started_at[name] = now
        self.metrics.restarts.labels(name).inc()
        self._event("restarted", entry, pid=proc.pid, restarts=entry["restarts"])

    def run(self, stop: threading.Event, interval_s: float) -> None:
        while not stop.wait(interval_s):
            self.tick()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m services.entrypoints.supervisor", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, required=True, help="the stack's run directory (stack.json, logs)")
    p.add_argument("--host", default="127.0.0.1", help="where the services' health ports listen")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus /metrics port (0: any; default: none)")
    p.add_argument("--interval-s", type=float, default=0.2, help="seconds between checks")
    p.add_argument("--restart-limit", type=int, default=Policy.restart_limit, help="restarts in a row, at most")
    p.add_argument("--backoff-s", type=float, default=Policy.backoff_s, help="wait before the first restart")
    p.add_argument("--max-backoff-s", type=float, default=Policy.max_backoff_s, help="longest wait before a restart")
    p.add_argument("--reset-after-s", type=float, default=Policy.reset_after_s, help="up this long: crashes forgotten")
    args = p.parse_args(argv)
    secrets = json.loads(sys.stdin.read() or "{}")  # service name → its secret variables, from `up`
    policy = Policy(args.restart_limit, args.backoff_s, args.max_backoff_s, args.reset_after_s)
    metrics = Metrics(prom.CollectorRegistry())
    supervisor = Supervisor(args.run_dir, args.host, policy, secrets, metrics, log=lambda line: print(line, flush=True))
    metrics_port = None
    if args.metrics_port is not None:
        http, _ = prom.start_http_server(args.metrics_port, addr=args.host, registry=metrics.registry)
        metrics_port = http.server_port
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    supervisor.record_self(Path("/proc/self/cmdline").read_bytes().decode().split("\0")[:-1], metrics_port)
    print(json.dumps({"event": "ready", "service": "supervisor", "metrics_port": metrics_port}), flush=True)
    supervisor.run(stop, args.interval_s)
    print(json.dumps({"event": "stopped", "service": "supervisor"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
