"""The service credential's interceptors (services/service_auth.py) on real gRPC servers, aio and sync, over
every call kind: no token, a wrong one or one in the wrong place is UNAUTHENTICATED before the handler runs,
the message names no secret; a channel from `aio_channel` / `channel` carries the token; health stays open."""

import asyncio
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services import service_auth

pytestmark = pytest.mark.timeout(60)
TOKEN = service_auth.new_token()
KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def echo_handler(calls: list[str], aio: bool) -> grpc.GenericRpcHandler:
    """/t.Echo/<kind>: answers b"ok" (once, or per message) and notes each call that reached it."""

    if aio:

        async def uu(request, context):
            calls.append("uu")
            return b"ok"

        async def us(request, context):
            calls.append("us")
            yield b"ok"

        async def su(requests, context):
            calls.append("su")
            async for _ in requests:
                pass
            return b"ok"

        async def ss(requests, context):
            calls.append("ss")
            async for _ in requests:
                yield b"ok"

    else:

        def uu(request, context):
            calls.append("uu")
            return b"ok"

        def us(request, context):
            calls.append("us")
            yield b"ok"

        def su(requests, context):
            calls.append("su")
            for _ in requests:
                pass
            return b"ok"

        def ss(requests, context):
            calls.append("ss")
            for _ in requests:
                yield b"ok"

    return grpc.method_handlers_generic_handler(
        "t.Echo",
        {
            "unary_unary": grpc.unary_unary_rpc_method_handler(uu),
            "unary_stream": grpc.unary_stream_rpc_method_handler(us),
            "stream_unary": grpc.stream_unary_rpc_method_handler(su),
            "stream_stream": grpc.stream_stream_rpc_method_handler(ss),
        },
    )


async def call_all(channel: grpc.aio.Channel) -> dict[str, object]:
    """Each kind once: its answer, or the status code it failed with."""
    out: dict[str, object] = {}
    for kind in KINDS:
        method = getattr(channel, kind)(f"/t.Echo/{kind}")
        try:
            if kind == "unary_unary":
                out[kind] = await method(b"x", timeout=10)
            elif kind == "unary_stream":
                out[kind] = [r async for r in method(b"x", timeout=10)]
            elif kind == "stream_unary":
                out[kind] = await method(iter([b"x", b"y"]), timeout=10)
            else:
                out[kind] = [r async for r in method(iter([b"x"]), timeout=10)]
        except grpc.aio.AioRpcError as err:
            assert TOKEN not in (err.details() or "")
            out[kind] = err.code()
    return out


ACCEPTED = {"unary_unary": b"ok", "unary_stream": [b"ok"], "stream_unary": b"ok", "stream_stream": [b"ok"]}
REFUSED = dict.fromkeys(KINDS, grpc.StatusCode.UNAUTHENTICATED)


async def check_server(port: int, calls: list[str]) -> None:
    address = f"127.0.0.1:{port}"
    async with grpc.aio.insecure_channel(address) as plain:
        assert await call_all(plain) == REFUSED
        reply = await health_pb2_grpc.HealthStub(plain).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING  # probes need no credential
    assert calls == []  # no handler ran
    async with service_auth.aio_channel(address, token="s" + "0" * 64) as wrong:
        assert await call_all(wrong) == REFUSED
    bearer = [("authorization", TOKEN)]  # the token without its scheme is not the credential
    async with grpc.aio.insecure_channel(address) as plain:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await plain.unary_unary("/t.Echo/unary_unary")(b"x", metadata=bearer, timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    async with service_auth.aio_channel(address, token=TOKEN) as right:
        assert await call_all(right) == ACCEPTED
    assert sorted(calls) == ["ss", "su", "us", "uu"]


def test_an_aio_server_refuses_every_call_kind_without_the_token():
    async def run():
        calls: list[str] = []
        server = grpc.aio.server(interceptors=service_auth.server_interceptors(TOKEN))
        server.add_generic_rpc_handlers((echo_handler(calls, aio=True),))
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            await check_server(port, calls)
        finally:
            await server.stop(None)

    asyncio.run(run())


def test_a_sync_server_refuses_every_call_kind_without_the_token():
    calls: list[str] = []
    server = grpc.server(futures.ThreadPoolExecutor(4), interceptors=service_auth.sync_server_interceptors(TOKEN))
    server.add_generic_rpc_handlers((echo_handler(calls, aio=False),))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        asyncio.run(check_server(port, calls))
        with service_auth.channel(f"127.0.0.1:{port}", token=TOKEN) as sync:  # the sync client carries it too
            assert sync.unary_unary("/t.Echo/unary_unary")(b"x", timeout=10) == b"ok"
            assert sync.unary_unary("/t.Echo/unary_unary").future(b"x", timeout=10).result() == b"ok"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:
            with pytest.raises(grpc.RpcError) as err:
                plain.unary_unary("/t.Echo/unary_unary")(b"x", timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop(None)


def test_without_a_token_in_the_environment_servers_are_open_and_clients_send_nothing(monkeypatch):
    monkeypatch.delenv(service_auth.TOKEN_ENV, raising=False)
    assert service_auth.server_interceptors() == [] and service_auth.sync_server_interceptors() == []
    monkeypatch.setenv(service_auth.TOKEN_ENV, TOKEN)
    assert len(service_auth.server_interceptors()) == 1 and service_auth.current_token() == TOKEN
