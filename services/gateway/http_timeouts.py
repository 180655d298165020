"""How long the gateway waits for a request's headers and body (``http_protocol.py`` enforces them): plain data,
so the stack's settings name them without importing the HTTP server; and the flags that set them."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class HttpTimeouts:
    header_s: float = DEFAULT_HEADER_TIMEOUT_S  # seconds a request's headers may take to arrive in full
    body_s: float = DEFAULT_BODY_TIMEOUT_S  # seconds its body may take, from the headers' end

    def __post_init__(self) -> None:
        for name in ("header_s", "body_s"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"the HTTP {name.removesuffix('_s')} timeout must be positive, got {value}")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def add_http_timeout_arguments(parser: argparse.ArgumentParser) -> None:
    """``--http-header-timeout`` and ``--http-body-timeout`` (of ``serve``, ``up`` and the gateway process)."""
    parser.add_argument(
        "--http-header-timeout",
        type=_seconds,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds an HTTP request's headers may take to arrive; then 408 and the connection closed "
        "(default %(default)g)",
    )
    parser.add_argument(
        "--http-body-timeout",
        type=_seconds,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds an HTTP request's body may take after its headers; then 408 and the connection closed "
        "(default %(default)g)",
    )


def http_timeouts(args: argparse.Namespace) -> HttpTimeouts:
    """The timeouts the flags of ``add_http_timeout_arguments`` give."""
    return HttpTimeouts(header_s=args.http_header_timeout, body_s=args.http_body_timeout)


def http_timeout_argv(timeouts: HttpTimeouts) -> list[str]:
    """The flags that give these timeouts to a gateway process (none for the defaults)."""
    if timeouts == HttpTimeouts():
        return []
    return ["--http-header-timeout", f"{timeouts.header_s:g}", "--http-body-timeout", f"{timeouts.body_s:g}"]
