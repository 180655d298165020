"""Probes of a service process: is its health port answering (`healthy`), and is its PID still running its
command (`alive_as`). `up`, `down`, `shinkai status`, the supervisor and the compose healthchecks use them."""

from __future__ import annotations

import os
import socket
from pathlib import Path


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
