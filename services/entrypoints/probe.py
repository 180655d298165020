"""Probes of a service process: is its health port answering (`healthy`; `health_state` adds where a starting
engine is), and is its PID still running its command (`alive_as`). `up`, `down`, `shinkai status`, the supervisor
and the compose healthchecks use them."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from services.worker.startup import METADATA_KEY, StartupState


def healthy(host: str, health: str) -> bool:
    return health_state(host, health)[0]


def health_state(host: str, health: str) -> tuple[bool, StartupState | None]:
    """(serving, where a process whose engine is still starting is: services/worker/startup.py; else None)."""
    kind, port = health.split(":")
    if kind == "tcp":
        try:
            with socket.create_connection((host, int(port)), timeout=0.5):
                return True, None
        except OSError:
            return False, None
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(f"{host}:{port}") as channel:
        try:
            reply, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
                health_pb2.HealthCheckRequest(service=""), timeout=1
            )
        except grpc.RpcError:
            return False, None
    starting = next((value for key, value in call.trailing_metadata() or () if key == METADATA_KEY), None)
    state = StartupState.from_json(starting) if starting is not None else None
    return reply.status == health_pb2.HealthCheckResponse.SERVING, state


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
