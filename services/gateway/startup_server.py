"""The ports of a process whose engine is still starting (loading, profiling, compiling, capturing), answering the
truth about it until the real server (`ApiServer`) takes the same ports over.

- grpc.health.v1: NOT_SERVING, with the ``StartupState`` (services/worker/startup.py) as JSON in the trailing
  metadata ``shinkai-startup`` of every Check (`probe.health_state` reads it; `shinkai up` prints it).
- HTTP, where the process serves HTTP (`shinkai serve`): /health and /ready 503 with
  ``{"status": "starting", "phase": …, "done": …, "total": …, "detail": …, "phase_s": …, "started_s": …}``
  (``StartupState``'s fields); any other path 503 with an OpenAI-style error naming the phase.

The process runs its engine's build off the event loop (``asyncio.to_thread``) between ``start()`` and ``stop()``,
then starts its real server on the ports bound here (``grpc_port``, ``http_port``: a 0 asked for any free one).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

import grpc
import uvicorn
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.gateway.api_server import EmbeddedUvicorn
from services.gateway.grpc_api import SERVICE
from services.worker.startup import METADATA_KEY, StartupProgress, StartupState


def startup_body(state: StartupState) -> dict:
    """/health's body while starting: "starting" and the state's fields."""
    return {"status": "starting", **json.loads(state.to_json())}


class _StartingHealth(health.aio.HealthServicer):
    """grpc.health.v1 that adds the startup line to each Check's trailing metadata."""

    def __init__(self, progress: StartupProgress) -> None:
        super().__init__()
        self.progress = progress

    async def Check(self, request: health_pb2.HealthCheckRequest, context) -> health_pb2.HealthCheckResponse:  # noqa: N802 - grpc's name
        reply = await super().Check(request, context)
        context.set_trailing_metadata(((METADATA_KEY, self.progress.state().to_json()),))
        return reply


class StartupServer:
    def __init__(
        self,
        progress: StartupProgress,
        host: str,
        grpc_port: int,
        http_port: int | None = None,
        tls: tuple[str, str] | None = None,
    ) -> None:
        self.progress = progress  # whose state every probe reads
        self.host = host  # bind address of both listeners
        self.tls = tls  # (certificate file, key file), both PEM, as the real server's; None: plaintext
        self.grpc_port = grpc_port  # bound port once started (asked: 0 for any free one)
        self.http_port = http_port  # None: no HTTP; bound port once started
        self._grpc: grpc.aio.Server | None = None
        self._uvicorn: EmbeddedUvicorn | None = None
        self._http_task: asyncio.Task | None = None

    async def start(self) -> None:
        self._grpc = grpc.aio.server()
        servicer = _StartingHealth(self.progress)
        for name in ("", SERVICE):
            await servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(servicer, self._grpc)
        address = f"{self.host}:{self.grpc_port}"
        if self.tls is not None:
            cert, key = (open(path, "rb").read() for path in self.tls)
            self.grpc_port = self._grpc.add_secure_port(address, grpc.ssl_server_credentials([(key, cert)]))
        else:
            self.grpc_port = self._grpc.add_insecure_port(address)
        await self._grpc.start()
        if self.http_port is not None:
            await self._start_http(self.http_port)

    async def _start_http(self, port: int) -> None:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, port))
        self.http_port = sock.getsockname()[1]

        async def starting(request: Request) -> JSONResponse:
            state = self.progress.state()
            if request.url.path in ("/health", "/ready"):
                return JSONResponse(startup_body(state), status_code=503)
            error = {
                "message": f"the server is starting: {state.describe()}",
                "type": "unavailable",
                "code": "starting",
            }
            return JSONResponse({"error": error}, status_code=503, headers={"Retry-After": "5"})

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
        app = Starlette(routes=[Route("/{path:path}", starting, methods=methods)])
        tls = {"ssl_certfile": self.tls[0], "ssl_keyfile": self.tls[1]} if self.tls is not None else {}
        self._uvicorn = EmbeddedUvicorn(uvicorn.Config(app, log_level="warning", access_log=False, **tls))
        self._http_task = asyncio.create_task(self._uvicorn.serve(sockets=[sock]))
        while not self._uvicorn.started:
            if self._http_task.done():
                self._http_task.result()  # raises what uvicorn raised
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        """Closes both listeners (the ports are free for the real server when this returns)."""
        if self._uvicorn is not None and self._http_task is not None:
            self._uvicorn.should_exit = True
            await self._http_task
        if self._grpc is not None:
            await self._grpc.stop(None)


class StartupServerThread:
    """The startup server for a process without an event loop (the worker process): on a thread of its own."""

    def __init__(self, progress: StartupProgress, host: str, grpc_port: int) -> None:
        self.server = StartupServer(progress, host, grpc_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="startup-health", daemon=True)

    def start(self) -> int:
        """Serves; returns the bound gRPC port."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result()
        return self.server.grpc_port

    def stop(self) -> None:
        """Closes the listener (its port is free when this returns) and ends the thread."""
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
