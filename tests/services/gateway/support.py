"""What the gateway tests share besides fixtures: an in-process `shinkai serve` on a thread, the check that an
engine's pools are whole, a server of a test's own, the gateway's command line under `shinkai up`, and the raw
HTTP and gRPC calls that tests make below the clients.

The server's event loop runs in a background thread; tests talk to it over real sockets with real clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlparse

import grpc
import pytest

from services.engine.stats import EngineStats
from services.gateway.server import ServeConfig, Server
from services.proto.shinkai.v1 import shinkai_pb2 as pb


class ServerThread:
    def __init__(self, config: ServeConfig) -> None:
        self.server = Server(config)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.start())
        self._ready.set()
        self.loop.run_forever()

    def start(self) -> "ServerThread":
        self._thread.start()
        assert self._ready.wait(60), "server did not start"
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

    @property
    def http_url(self) -> str:
        return self.server.urls()["http"]

    @property
    def grpc_target(self) -> str:
        return self.server.urls()["grpc"]


def pools_whole(stats: EngineStats) -> bool:
    return (
        stats.free_blocks == stats.total_blocks
        and stats.free_state_slots == stats.total_state_slots
        and stats.num_running == stats.num_waiting == 0
    )


@contextlib.contextmanager
def own_server(**config) -> Iterator[ServerThread]:
    """A tiny-model server of the caller's own (HTTP and gRPC on free loopback ports, a 5 s drain unless
    ``config`` says otherwise; ``config``: more `ServeConfig` fields). Stopped on leaving; left normally, its
    engine's pools must then be whole."""
    thread = ServerThread(
        ServeConfig(**{"model": "tiny", "http_port": 0, "grpc_port": 0, "drain_timeout_s": 5, **config})
    ).start()
    try:
        yield thread
    finally:
        thread.stop()
    assert pools_whole(thread.server.engine.stats())


def wait_whole(served: ServerThread, timeout: float = 30.0) -> None:
    """Waits until the server's engine has no request left and its pools are whole (a stream's end reaches
    the engine asynchronously)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pools_whole(served.server.engine.stats()) and served.server.engine.num_unfinished() == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"pools not whole: {served.server.engine.stats()}")


def gateway_argv(config) -> list[str]:
    """The gateway process's command line in the stack of ``config`` (a `StackConfig`), as `shinkai up` runs it."""
    from services.entrypoints.service_list import services

    return {s.name: s for s in services(config)}["gateway"].argv


def post(url: str, path: str, body, headers: dict | None = None, timeout: float = 30) -> tuple[int, dict, dict]:
    """POSTs ``body`` (JSON, or bytes as they are) with ``headers`` besides its Content-Type; the status, the
    reply's JSON and its headers, for an error status too."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r), dict(r.headers)
    except urllib.error.HTTPError as err:
        return err.code, json.load(err), dict(err.headers)


def raw_request(url: str, method: str, path: str, body: bytes = b"", headers: dict | None = None):
    """One HTTP request exactly as given (no client adds or checks anything): status, body bytes, headers."""
    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, data, {k.lower(): v for k, v in resp.getheaders()}


def generate(target: str, request: pb.GenerateRequest) -> list[pb.GenerateResponse]:
    """shinkai.v1 Generate with the request message as built (no client checks it first): every response."""
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_stream(
            "/shinkai.v1.Shinkai/Generate",
            request_serializer=pb.GenerateRequest.SerializeToString,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        return list(call(request, timeout=30))


def refusal(target: str, request: pb.GenerateRequest) -> grpc.RpcError:
    """The error that `generate` must end with."""
    with pytest.raises(grpc.RpcError) as info:
        generate(target, request)
    return info.value
