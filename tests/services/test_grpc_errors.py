"""services/grpc_errors.py: a handler's unexpected exception reaches the client as INTERNAL "internal error",
never UNKNOWN with the exception's text; the handler's own abort (bad input) passes through unchanged. On a
grpc.aio server and on a thread-pool one, for unary and streaming responses."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest

from services.grpc_errors import AioNoInternalText, NoInternalText

pytestmark = pytest.mark.timeout(60)
SECRET = "/srv/secret/path.py line 12: token=abc"


def _handlers(aio: bool) -> grpc.GenericRpcHandler:
    if aio:

        async def fail(request, context):
            raise RuntimeError(SECRET)

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")

        async def fail_streaming(request, context):
            yield b"one"
            raise RuntimeError(SECRET)

    else:

        def fail(request, context):
            raise RuntimeError(SECRET)

        def refuse(request, context):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt is empty")

        def fail_streaming(request, context):
            yield b"one"
            raise RuntimeError(SECRET)

    return grpc.method_handlers_generic_handler(
        "t.T",
        {
            "Fail": grpc.unary_unary_rpc_method_handler(fail),
            "Refuse": grpc.unary_unary_rpc_method_handler(refuse),
            "FailStreaming": grpc.unary_stream_rpc_method_handler(fail_streaming),
        },
    )


def _calls(target: str) -> dict[str, grpc.RpcError]:
    got = {}
    with grpc.insecure_channel(target) as channel:
        for name in ("Fail", "Refuse"):
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(f"/t.T/{name}")(b"", timeout=10)
            got[name] = info.value
        with pytest.raises(grpc.RpcError) as info:
            list(channel.unary_stream("/t.T/FailStreaming")(b"", timeout=10))
        got["FailStreaming"] = info.value
    return got


def _check(got: dict[str, grpc.RpcError]) -> None:
    for name in ("Fail", "FailStreaming"):
        assert got[name].code() == grpc.StatusCode.INTERNAL, (name, got[name].details())
        assert got[name].details() == "internal error"
    assert got["Refuse"].code() == grpc.StatusCode.INVALID_ARGUMENT
    assert got["Refuse"].details() == "the prompt is empty"


def test_an_aio_server_sends_no_exception_text():
    loop = asyncio.new_event_loop()
    server = None

    async def start() -> int:
        nonlocal server
        server = grpc.aio.server(interceptors=[AioNoInternalText()])
        server.add_generic_rpc_handlers((_handlers(aio=True),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return port

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        port = asyncio.run_coroutine_threadsafe(start(), loop).result(10)
        _check(_calls(f"127.0.0.1:{port}"))
    finally:
        if server is not None:
            asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def test_a_thread_pool_server_sends_no_exception_text():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=[NoInternalText()])
    server.add_generic_rpc_handlers((_handlers(aio=False),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        _check(_calls(f"127.0.0.1:{port}"))
    finally:
        server.stop(None)
