"""The gateway's one error type and how it reads over HTTP (OpenAI error bodies) and gRPC (status codes).

Bad input is never a 500, UNKNOWN or INTERNAL: every refusal is an `ApiError` with a message that says
what is wrong, raised before anything is queued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc


@dataclass(frozen=True)
class ErrorKind:
    http_status: int  # HTTP status code
    grpc_code: grpc.StatusCode  # gRPC status code
    openai_type: str  # OpenAI error body's "type"


INVALID = ErrorKind(400, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error")
NOT_FOUND = ErrorKind(404, grpc.StatusCode.NOT_FOUND, "invalid_request_error")
TOO_LARGE = ErrorKind(413, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error")
UNSUPPORTED_MEDIA = ErrorKind(415, grpc.StatusCode.INVALID_ARGUMENT, "invalid_request_error")
QUEUE_FULL = ErrorKind(429, grpc.StatusCode.RESOURCE_EXHAUSTED, "rate_limit_error")
UNAVAILABLE = ErrorKind(503, grpc.StatusCode.UNAVAILABLE, "service_unavailable")
INTERNAL = ErrorKind(500, grpc.StatusCode.INTERNAL, "internal_error")


ERROR_CODE_KEY = "error-code"  # gRPC trailing metadata: the ApiError's code


class ApiError(Exception):
    def __init__(
        self,
        kind: ErrorKind,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        # The request field at fault, when there is one (OpenAI's "param").
        self.param = param
        # A short machine-readable code (OpenAI's "code"), e.g. "model_not_found".
        self.code = code
        # Seconds to wait before retrying (429 Retry-After / "retry-after" trailing metadata).
        self.retry_after_s = retry_after_s

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {"message": self.message, "type": self.kind.openai_type, "param": self.param, "code": self.code}
        }

    def http_headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def grpc_trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        """ "retry-after" (seconds) when set, and "error-code" (the OpenAI body's code) when set, so a gateway
        in front of an engine passes the code on."""
        metadata = (("retry-after", str(self.retry_after_s)),) if self.retry_after_s is not None else ()
        return metadata + ((ERROR_CODE_KEY, self.code),) if self.code is not None else metadata


def invalid(message: str, param: str | None = None) -> ApiError:
    return ApiError(INVALID, message, param)
