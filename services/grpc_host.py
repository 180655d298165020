"""A gRPC service process's life after its handlers are added: Prometheus metrics, gRPC health, the JSON
"ready" and "stopped" lines `shinkai up` reads, and a drain on SIGTERM or SIGINT (health NOT_SERVING,
then up to 5 s for live calls)."""

from __future__ import annotations

import asyncio
import json
import signal

import grpc
import prometheus_client as prom
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


async def serve_until_signalled(
    server: grpc.aio.Server,
    *,
    service: str,
    health_name: str,
    grpc_addr: str,
    metrics_port: int | None,
    registry: prom.CollectorRegistry,
) -> int:
    """Binds ``grpc_addr`` (and ``metrics_port``: 0 = any, None = no metrics), marks ``health_name`` and the
    server SERVING, prints the ready line, and returns 0 once a signal has drained the server."""
    if metrics_port is not None:
        http, _ = prom.start_http_server(metrics_port, addr=grpc_addr.rsplit(":", 1)[0], registry=registry)
        metrics_port = http.server_port
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    port = server.add_insecure_port(grpc_addr)
    await server.start()
    for name in ("", health_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(
        json.dumps({"event": "ready", "service": service, "grpc_port": port, "metrics_port": metrics_port}), flush=True
    )
    await stop.wait()
    for name in ("", health_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await server.stop(grace=5.0)
    print(json.dumps({"event": "stopped", "service": service}), flush=True)
    return 0
