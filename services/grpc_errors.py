"""gRPC server interceptors that keep internal exception text off the wire.

A handler that raises anything but its own ``context.abort(...)`` would reach the client as UNKNOWN with the
exception's type and text in the status details ("Unexpected <class ...>: ..."): internals (paths, library
messages, values) leak, and the client cannot tell a bug from bad input. With these interceptors such a call
ends INTERNAL "internal error" and the exception goes to the server's log; bad input is still the handler's
own INVALID_ARGUMENT (or other code) with a message naming the problem. ``AioNoInternalText`` serves
grpc.aio servers, ``NoInternalText`` thread-pool ones.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any

import grpc

log = logging.getLogger("shinkai.grpc")
MESSAGE = "internal error"


def _rebuilt(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable, bool], Callable]) -> grpc.RpcMethodHandler:
    """The handler with its behaviour wrapped (``wrap(behaviour, streams_out)``), serializers kept."""
    kinds = (
        ("unary_unary", grpc.unary_unary_rpc_method_handler, False),
        ("unary_stream", grpc.unary_stream_rpc_method_handler, True),
        ("stream_unary", grpc.stream_unary_rpc_method_handler, False),
        ("stream_stream", grpc.stream_stream_rpc_method_handler, True),
    )
    for attr, make, streams_out in kinds:
        behaviour = getattr(handler, attr)
        if behaviour is not None:
            return make(
                wrap(behaviour, streams_out),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
    return handler


def _aio_wrapped(behaviour: Callable, streams_out: bool) -> Callable:
    if streams_out and inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext):
            try:
                async for response in behaviour(request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception:
                log.exception("unexpected error in %s", getattr(behaviour, "__qualname__", behaviour))
                await context.abort(grpc.StatusCode.INTERNAL, MESSAGE)

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext):
        try:
            return await behaviour(request, context)
        except grpc.aio.AbortError:
            raise
        except Exception:
            log.exception("unexpected error in %s", getattr(behaviour, "__qualname__", behaviour))
            await context.abort(grpc.StatusCode.INTERNAL, MESSAGE)

    return call


class AioNoInternalText(grpc.aio.ServerInterceptor):
    """For ``grpc.aio.server(interceptors=[AioNoInternalText()])``."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        return None if handler is None else _rebuilt(handler, _aio_wrapped)


def _sync_wrapped(behaviour: Callable, streams_out: bool) -> Callable:
    def fail(context: grpc.ServicerContext) -> None:
        log.exception("unexpected error in %s", getattr(behaviour, "__qualname__", behaviour))
        context.abort(grpc.StatusCode.INTERNAL, MESSAGE)

    if streams_out:

        def stream(request: Any, context: grpc.ServicerContext):
            try:
                yield from behaviour(request, context)
            except Exception:
                if context.code() is not None:  # the handler's own context.abort(...)
                    raise
                fail(context)

        return stream

    def call(request: Any, context: grpc.ServicerContext):
        try:
            return behaviour(request, context)
        except Exception:
            if context.code() is not None:
                raise
            fail(context)

    return call


class NoInternalText(grpc.ServerInterceptor):
    """For ``grpc.server(executor, interceptors=[NoInternalText()])``."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        return None if handler is None else _rebuilt(handler, _sync_wrapped)
