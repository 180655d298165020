"""Ports that one process picks for another to bind later (`shinkai up`, a gateway's rank group).

A port picked by binding port 0 comes from the kernel's ephemeral range (``ip_local_port_range``): the range
from which every outgoing connection and every port-0 listener on the host also takes its local port. Between
the pick and the service's own bind any of those may take it (a data-parallel engine once failed to bind its
gRPC port so). `free_port` therefore picks below that range, where only explicit binds land, and checks each
pick by binding it.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

PICK_FLOOR = 16384  # lowest port picked: below it lie the well-known ports other software listens on
MIN_PICK_SPAN = 1024  # fewer free candidates than this below the ephemeral range: pick from it after all
_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_FALLBACK_EPHEMERAL_LOW = 32768  # Linux's default low end, where the file cannot be read
_NUM_TRIES = 64


def ephemeral_low() -> int:
    """The lowest port the kernel hands out for port-0 binds and outgoing connections."""
    try:
        return int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _any_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def free_port(host: str) -> int:
    """A port on ``host`` that nothing holds now, below the ephemeral range where the host allows it."""
    high = ephemeral_low()
    if high - PICK_FLOOR >= MIN_PICK_SPAN:
        draw = random.SystemRandom()  # independent of any seed a caller set
        for _ in range(_NUM_TRIES):
            port = draw.randrange(PICK_FLOOR, high)
            if _bindable(host, port):
                return port
    return _any_port(host)
