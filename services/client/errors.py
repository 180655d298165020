"""Typed client errors, mapped from gRPC status codes (the server never sends errors in-band)."""

from __future__ import annotations

import grpc


class ShinkaiError(Exception):
    """A failed call; ``code`` is the gRPC status code, ``details`` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        # Seconds the server asked to wait before retrying (RESOURCE_EXHAUSTED only).
        self.retry_after_s = retry_after_s


class InvalidArgument(ShinkaiError):
    """Bad input; the message says what is wrong."""


class ModelNotFound(ShinkaiError):
    """The server does not serve the requested model."""


class ResourceExhausted(ShinkaiError):
    """The server's queue is full (RESOURCE_EXHAUSTED; HTTP 429); retry after ``retry_after_s``."""


class Unavailable(ShinkaiError):
    """The server is unreachable or draining."""


class Timeout(ShinkaiError):
    """The call's deadline passed (the server aborts the request)."""


class Cancelled(ShinkaiError):
    """The call was cancelled by this client."""


_BY_CODE: dict[grpc.StatusCode, type[ShinkaiError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: Timeout,
    grpc.StatusCode.CANCELLED: Cancelled,
}


def from_rpc_error(err: grpc.RpcError, trailing: tuple | None = None) -> ShinkaiError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(err)
    retry_after = None
    for key, value in trailing or ():
        if key == "retry-after":
            retry_after = float(value)
    return _BY_CODE.get(code, ShinkaiError)(code, details, retry_after)
