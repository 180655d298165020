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


class QueueFull(ShinkaiError):
    """The server's queue is full; retry after ``retry_after_s``."""


class MessageTooLarge(ShinkaiError):
    """A request or response over gRPC's message-size limit (RESOURCE_EXHAUSTED without retry-after): retrying
    the same call fails the same way."""


class ResourceExhausted(ShinkaiError):
    """RESOURCE_EXHAUSTED for another reason than a full queue or the message size."""


class Unauthenticated(ShinkaiError):
    """No API key, or the wrong one (the server runs with --api-key)."""


class Unavailable(ShinkaiError):
    """The server is unreachable or draining."""


class Timeout(ShinkaiError):
    """The call's deadline passed (the server aborts the request)."""


class Cancelled(ShinkaiError):
    """The call was cancelled by this client."""


_BY_CODE: dict[grpc.StatusCode, type[ShinkaiError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: ModelNotFound,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
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
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # Only a full queue sends retry-after; grpc's own message-size refusal says "larger than max".
        if retry_after is not None:
            return QueueFull(code, details, retry_after)
        kind = MessageTooLarge if "larger than max" in details else ResourceExhausted
        return kind(code, details)
    return _BY_CODE.get(code, ShinkaiError)(code, details, retry_after)
