"""The service credential: one shared token per stack that every internal gRPC call carries, so only the
stack's own services can call an engine, a worker, the tokenizer or the multimodal service.

Invariants:
- `shinkai up` generates the token (`new_token`) and gives it, in ``SHINKAI_SERVICE_TOKEN``, to every Shinkai
  service's environment (never a command line, never stack.json); compose reads it from its ``.env``
  (deploy/README.md); `shinkai serve --dp N` makes one for its rank processes.
- A server built with `server_interceptors()` (aio) or `sync_server_interceptors()` refuses every call
  without ``authorization: Bearer <token>`` metadata with UNAUTHENTICATED, before the handler runs; the
  token is compared in constant time and never echoed. grpc.health.v1 (`OPEN_METHOD_PREFIXES`) stays open
  for orchestrators' probes.
- A client channel from `aio_channel()` or `channel()` adds the token to every call it makes.
- Without the variable set (a lone service in a test, `shinkai serve`) servers are open and clients send
  nothing, as before.
"""

from __future__ import annotations

import collections
import hmac
import os
import secrets
from collections.abc import Sequence

import grpc

TOKEN_ENV = "SHINKAI_SERVICE_TOKEN"
METADATA_KEY = "authorization"  # the same key the gateway's API keys use: any gRPC client can send it
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)  # probes need no credential
REFUSAL = "this service takes calls from the stack's own services only: no valid service credential was sent"


def new_token() -> str:
    """256 random bits as ``s`` and 64 hex digits."""
    return "s" + secrets.token_hex(32)


def current_token() -> str | None:
    """The token in this process's environment, if any."""
    return os.environ.get(TOKEN_ENV) or None


def _metadata_value(token: str) -> str:
    return f"Bearer {token}"


def _authorized(method: str, metadata: Sequence[tuple[str, str | bytes]] | None, expected: bytes) -> bool:
    if method.startswith(OPEN_METHOD_PREFIXES):
        return True
    found = False
    for key, value in metadata or ():
        if key == METADATA_KEY:
            presented = value if isinstance(value, bytes) else value.encode()
            found |= hmac.compare_digest(presented, expected)
    return found


def _deny_handler(handler: grpc.RpcMethodHandler, *, aio: bool) -> grpc.RpcMethodHandler:
    """A handler of ``handler``'s kind (unary or streaming either way) that refuses the call."""

    if aio:

        async def behaviour(_request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    elif handler.response_streaming:

        def behaviour(request, context):
            # The status set and an empty stream returned, after a streamed request's first message (or its
            # end): ending a sync call before the client has written races its writes, which can reach the
            # client as INTERNAL instead of the refusal.
            if handler.request_streaming:
                next(request, None)
            context.set_code(grpc.StatusCode.UNAUTHENTICATED)
            context.set_details(REFUSAL)
            return iter(())
    else:

        def behaviour(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSAL)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(
        behaviour, request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )


class _AioServerCheck(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = _metadata_value(token).encode()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or _authorized(
            handler_call_details.method, handler_call_details.invocation_metadata, self._expected
        ):
            return handler
        return _deny_handler(handler, aio=True)


class _SyncServerCheck(grpc.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = _metadata_value(token).encode()

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or _authorized(
            handler_call_details.method, handler_call_details.invocation_metadata, self._expected
        ):
            return handler
        return _deny_handler(handler, aio=False)


def server_interceptors(token: str | None = None) -> list[grpc.aio.ServerInterceptor]:
    """For ``grpc.aio.server(interceptors=...)``: the check of ``token`` (default: the environment's); none
    without a token."""
    token = token or current_token()
    return [_AioServerCheck(token)] if token else []


def sync_server_interceptors(token: str | None = None) -> list[grpc.ServerInterceptor]:
    """For ``grpc.server(interceptors=...)``, as `server_interceptors`."""
    token = token or current_token()
    return [_SyncServerCheck(token)] if token else []


def _with_token(details, token: str):
    metadata = [*(details.metadata or ()), (METADATA_KEY, _metadata_value(token))]
    return details._replace(metadata=metadata)


# grpc.aio files a channel's interceptor under the first call kind it is an instance of: one class per kind.
class _AioUnaryUnaryToken(grpc.aio.UnaryUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.token), request)


class _AioUnaryStreamToken(grpc.aio.UnaryStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_token(client_call_details, self.token), request)


class _AioStreamUnaryToken(grpc.aio.StreamUnaryClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self.token), request_iterator)


class _AioStreamStreamToken(grpc.aio.StreamStreamClientInterceptor):
    def __init__(self, token: str) -> None:
        self.token = token

    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_token(client_call_details, self.token), request_iterator)


# grpc's sync ClientCallDetails is an interface without a constructor: this is the usual concrete one.
_SyncDetails = collections.namedtuple(
    "_SyncDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
)


class _SyncClientToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self.token = token

    def _details(self, d):
        details = _SyncDetails(
            d.method, d.timeout, d.metadata, d.credentials, getattr(d, "wait_for_ready", None), d.compression
        )
        return _with_token(details, self.token)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def aio_channel(address: str, options=None, token: str | None = None) -> grpc.aio.Channel:
    """``grpc.aio.insecure_channel`` whose every call carries ``token`` (default: the environment's)."""
    token = token or current_token()
    kinds = (_AioUnaryUnaryToken, _AioUnaryStreamToken, _AioStreamUnaryToken, _AioStreamStreamToken)
    interceptors = [kind(token) for kind in kinds] if token else None
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def channel(address: str, options=None, token: str | None = None) -> grpc.Channel:
    """``grpc.insecure_channel`` whose every call carries ``token`` (default: the environment's)."""
    token = token or current_token()
    plain = grpc.insecure_channel(address, options=options)
    return grpc.intercept_channel(plain, _SyncClientToken(token)) if token else plain
