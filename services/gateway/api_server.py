"""HTTP (uvicorn + FastAPI) and gRPC (shinkai.v1 + grpc.health.v1) endpoints for one `Frontend`, on one
asyncio loop. Shared by `shinkai serve`, an engine process (gRPC only) and the gateway process.

``close_intake()`` turns health NOT_SERVING, /health 503 and new requests 503 / UNAVAILABLE; ``stop()``
then closes the listeners (live HTTP streams get a few seconds). ``set_problem(why)`` does the same while a
dependency is gone (a dead worker, no engine reachable) and ``set_problem(None)`` undoes it; /health names
the problem. Invariant: SERVING ⇔ taking requests and no problem.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator, Sequence

import anyio
import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.gateway.auth import Keys
from services.gateway.frontend import Frontend
from services.gateway.grpc_api import SERVICE, ShinkaiApi
from services.gateway.http_protocol import protocol_with
from services.gateway.http_timeouts import HttpTimeouts
from services.gateway.openai.http import build_app
from services.grpc_errors import AioNoInternalText


class EmbeddedUvicorn(uvicorn.Server):
    """uvicorn that leaves SIGTERM/SIGINT to the embedding process, which drains in its own order (uvicorn's
    own handler would close HTTP streams at once)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class ApiServer:
    def __init__(
        self,
        frontend: Frontend,
        host: str,
        http_port: int | None,
        grpc_port: int,
        keys: Keys | None = None,
        tls: tuple[str, str] | None = None,
        max_receive_bytes: int | None = None,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
        http_timeouts: HttpTimeouts = HttpTimeouts(),
    ) -> None:
        self.frontend = frontend
        # gRPC server interceptors: an engine process checks the service credential (services/service_auth.py).
        self.interceptors = list(interceptors)
        self.http_timeouts = http_timeouts  # read deadlines of a request's headers and body (HTTP only)
        # The largest gRPC request taken; None: grpc's default (4 MiB). An engine process takes a chat's images.
        self.max_receive_bytes = max_receive_bytes
        self.tls = tls  # (certificate file, key file), both PEM: HTTPS and TLS gRPC; None: plaintext
        self.keys = keys or Keys()  # API keys for HTTP and gRPC; none: open
        self.host = host  # bind address of both listeners
        self._want_http_port = http_port  # None: no HTTP; 0: any free port
        self._want_grpc_port = grpc_port  # 0: any free port
        self.ready = False  # taking new requests (False from close_intake on, for good)
        self.problem: str | None = None  # a dependency that is gone, while it is gone
        self.health = health.aio.HealthServicer()
        self.http_port: int | None = None  # bound ports, once started
        self.grpc_port: int | None = None
        self._grpc: grpc.aio.Server | None = None
        self._uvicorn: EmbeddedUvicorn | None = None
        self._http_task: asyncio.Task | None = None

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def start(self) -> None:
        options = [("grpc.max_receive_message_length", self.max_receive_bytes)] if self.max_receive_bytes else []
        self._grpc = grpc.aio.server(options=options, interceptors=[*self.interceptors, AioNoInternalText()])
        self._grpc.add_generic_rpc_handlers(
            (ShinkaiApi(self.frontend, self.serving, self.health_problem, self.keys).handler(),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        address = f"{self.host}:{self._want_grpc_port}"
        if self.tls is not None:
            cert, key = (open(path, "rb").read() for path in self.tls)
            self.grpc_port = self._grpc.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.grpc_port = self._grpc.add_insecure_port(address)
        await self._set_health(False)
        await self._grpc.start()
        if self._want_http_port is not None:
            try:
                await self._start_http(self._want_http_port)
            except BaseException:
                await self._grpc.stop(None)  # nothing may outlive a failed start
                raise
        self.ready = True
        await self._set_health(self.serving())

    async def _start_http(self, port: int) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        self.http_port = sock.getsockname()[1]
        app = build_app(self.frontend, is_ready=self.serving, health_problem=self.health_problem, keys=self.keys)
        tls = {"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]} if self.tls is not None else {}
        self._uvicorn = EmbeddedUvicorn(
            uvicorn.Config(
                app,
                http=protocol_with(self.http_timeouts),
                log_level="warning",
                access_log=False,
                timeout_graceful_shutdown=5,
                **tls,
            )
        )
        self._http_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._http_task.done():
                self._http_task.result()  # raises what uvicorn raised
            await asyncio.sleep(0.01)
        # Starlette streams a response in an anyio task group, and anyio imports its asyncio backend on first use
        # (~20 ms on a CPU core): done here, before health says SERVING, so the first stream does not wait for it.
        await anyio.sleep(0)

    def serving(self) -> bool:
        return self.ready and self.problem is None

    def health_problem(self) -> str | None:
        """None while serving; else why not ("draining", or the dependency that is gone)."""
        return None if self.serving() else ("draining" if not self.ready else self.problem)

    async def set_problem(self, problem: str | None) -> None:
        self.problem = problem
        await self._set_health(self.serving())

    async def close_intake(self) -> None:
        self.ready = False
        await self._set_health(False)

    async def stop(self) -> None:
        await self.close_intake()
        if self._uvicorn is not None and self._http_task is not None:
            self._uvicorn.should_exit = True
            await self._http_task
        if self._grpc is not None:
            await self._grpc.stop(grace=1.0)

    def urls(self) -> dict[str, str]:
        urls = {"grpc": f"{self.host}:{self.grpc_port}"}
        if self.http_port is not None:
            urls["http"] = f"{'https' if self.tls else 'http'}://{self.host}:{self.http_port}"
        return urls
