"""The EPLB planner service: load reports from NATS in, versioned layer plans to NATS out.

It subscribes to ``subjects.EXPERT_LOAD``, feeds a ``Planner``, and when a re-plan is due plans every layer
in a worker thread (so NATS pings and health checks keep being answered) and publishes each applied layer
plan on ``subjects.EXPERT_PLAN``. Health is ``grpc.health.v1`` (service names "" and ``HEALTH_NAME``);
metrics are Prometheus. SIGTERM drains: health turns NOT_SERVING, the subscription stops taking new
messages, messages already received are processed (a due re-plan finishes and is published), then exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from concurrent import futures
from typing import Any

import grpc
import prometheus_client as prom
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from observability import metrics as names
from observability import tracing
from services import nats_auth, subjects
from services.eplb.messages import MessageError, decode_load
from services.eplb.planner import Planner, PlannerConfig

HEALTH_NAME = "shinkai.eplb.Planner"
log = logging.getLogger("shinkai.eplb")


@dataclasses.dataclass(frozen=True)
class ServiceConfig:
    """Where the service listens and talks."""

    planner: PlannerConfig  # what to plan and how often
    nats_url: str = "nats://127.0.0.1:4222"  # NATS server
    health_addr: str = "127.0.0.1:0"  # grpc.health.v1 bind address; port 0 picks a free port
    metrics_port: int | None = None  # Prometheus /metrics port on 0.0.0.0; None: no endpoint; 0: any free


class Metrics:
    """The planner's Prometheus metrics, on their own registry."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        self.moe_lb = prom.Gauge(
            names.MOE_LB, "moe_lb of the layout in force on its planning window", ["layer"], registry=self.registry
        )
        self.published = prom.Counter(names.EPLB_PUBLISHED, "layer plans published", registry=self.registry)
        self.rejected = prom.Counter(names.EPLB_REJECTED, "layer candidates the guard refused", registry=self.registry)
        self.reports = prom.Counter(names.EPLB_REPORTS, "load reports taken", registry=self.registry)
        self.bad = prom.Counter(names.EPLB_BAD, "load reports dropped as malformed", registry=self.registry)
        self.plan_seconds = prom.Histogram(
            names.EPLB_REPLAN_SECONDS, "time to re-plan all layers", registry=self.registry
        )


class PlannerService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.planner = Planner(config.planner)
        self.metrics = Metrics()
        self.health = health.HealthServicer()
        self.health_port: int | None = None
        self.metrics_port: int | None = None
        self._stop = asyncio.Event()
        # Set by start(); run_until_stopped() needs all three (the HTTP server only with a metrics port).
        self._nc: Any = None  # nats.aio.client.Client
        self._grpc: Any = None  # grpc.Server
        self._http: Any = None  # wsgiref WSGIServer of the metrics endpoint

    def _set_health(self, status: int) -> None:
        for name in ("", HEALTH_NAME):
            self.health.set(name, status)

    async def _on_load(self, msg) -> None:
        # A span only for reports sent from a traced engine step (their NATS headers carry its context).
        parent = tracing.extract(msg.headers)
        with (
            tracing.span("eplb.load_report", parent, kind=tracing.SpanKind.CONSUMER)
            if parent is not None
            else tracing.active(None)
        ):
            await self._take_load(msg)

    async def _take_load(self, msg) -> None:
        try:
            due = self.planner.add(decode_load(msg.data))
        except MessageError as err:
            self.metrics.bad.inc()
            log.warning("dropped load report on %s: %s", msg.subject, err)
            return
        self.metrics.reports.inc()
        if due:
            await self._replan()

    async def _replan(self) -> None:
        with self.metrics.plan_seconds.time():
            outcome = await asyncio.get_running_loop().run_in_executor(None, self.planner.replan)
        for layer, value in outcome.moe_lb.items():
            self.metrics.moe_lb.labels(layer=str(layer)).set(value)
        self.metrics.rejected.inc(outcome.num_rejected)
        for message in outcome.plans:
            await self._nc.publish(subjects.EXPERT_PLAN, message.encode())
            self.metrics.published.inc()
            log.info(
                "plan v%d layer %d: moe_lb %.4f -> %.4f, %d moves",
                message.version,
                message.layer,
                message.moe_lb_before,
                message.moe_lb_after,
                message.moves,
            )
        await self._nc.flush(timeout=5)  # every NATS round trip has a deadline

    async def start(self) -> None:
        import nats

        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        self.health_port = self._grpc.add_insecure_port(self.config.health_addr)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self._grpc.start()
        if self.config.metrics_port is not None:
            self._http, _ = prom.start_http_server(self.config.metrics_port, registry=self.metrics.registry)
            self.metrics_port = self._http.server_port

        async def on_error(err: Exception) -> None:
            log.warning("nats: %s", err or type(err).__name__)

        self._nc = await nats.connect(
            self.config.nats_url,
            name="shinkai-eplb",
            max_reconnect_attempts=-1,
            error_cb=on_error,
            **nats_auth.connect_options(),
        )
        await self._nc.subscribe(subjects.every_replica(subjects.EXPERT_LOAD), cb=self._on_load)
        await self._nc.flush(timeout=5)  # every NATS round trip has a deadline
        self._set_health(health_pb2.HealthCheckResponse.SERVING)

    def request_stop(self) -> None:
        self._stop.set()

    @property
    def stop_requested(self) -> bool:
        """Whether SIGTERM (``request_stop``) has come."""
        return self._stop.is_set()

    async def start_or_stop(self, timeout: float) -> bool:
        """``start`` unless SIGTERM comes first or NATS is unreachable for ``timeout`` s; True if started."""
        starting = asyncio.ensure_future(self.start())
        stopping = asyncio.ensure_future(self._stop.wait())
        await asyncio.wait({starting, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if starting.done() and starting.exception() is None:
            return True
        if starting.done():
            log.error("start-up failed: %s", starting.exception())
        else:
            starting.cancel()
            with contextlib.suppress(BaseException):
                await starting
        await self.close()
        return False

    async def run_until_stopped(self) -> None:
        await self._stop.wait()
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._nc.drain()  # stops new messages, finishes the handlers (and any due re-plan)
        await self.close()

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()
        if self._http is not None:
            self._http.shutdown()
        if self._grpc is not None:
            self._grpc.stop(grace=1.0).wait()
