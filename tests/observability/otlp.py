"""Test helpers: an OTLP/gRPC trace receiver (opentelemetry-proto's TraceService), one span record type for
spans from it and from the SDK's in-memory exporter, and a text rendering of a span tree."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tpb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc


@dataclass(frozen=True)
class SpanRecord:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[SpanRecord] = []
        self.lock = threading.Lock()

    def Export(self, request: tpb.ExportTraceServiceRequest, context: Any) -> tpb.ExportTraceServiceResponse:
        got = []
        for rs in request.resource_spans:
            service = next((_value(a.value) for a in rs.resource.attributes if a.key == "service.name"), "?")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        SpanRecord(
                            service,
                            s.name,
                            s.trace_id.hex(),
                            s.span_id.hex(),
                            s.parent_span_id.hex() or None,
                            s.start_time_unix_nano,
                            s.end_time_unix_nano,
                            {a.key: _value(a.value) for a in s.attributes},
                        )
                    )
        with self.lock:
            self.spans.extend(got)
        return tpb.ExportTraceServiceResponse()


class OtlpReceiver:
    def __init__(self, service: _TraceService, port: int) -> None:
        self._service = service
        self.endpoint = f"http://127.0.0.1:{port}"

    def spans(self) -> list[SpanRecord]:
        with self._service.lock:
            return list(self._service.spans)

    def wait_for(self, predicate, timeout_s: float = 20.0) -> list[SpanRecord]:
        """Spans received so far once ``predicate(spans)`` holds; raises on timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            spans = self.spans()
            if predicate(spans):
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"spans never matched; got {sorted({(s.service, s.name) for s in spans})}")
            time.sleep(0.05)


@contextlib.contextmanager
def otlp_receiver() -> Iterator[OtlpReceiver]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    service = _TraceService()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield OtlpReceiver(service, port)
    finally:
        server.stop(None)


def from_sdk(spans: Any) -> list[SpanRecord]:
    """SpanRecords of the SDK's ReadableSpans (the in-memory exporter's)."""
    out = []
    for s in spans:
        ctx = s.get_span_context()
        out.append(
            SpanRecord(
                s.resource.attributes.get("service.name", "?"),
                s.name,
                format(ctx.trace_id, "032x"),
                format(ctx.span_id, "016x"),
                format(s.parent.span_id, "016x") if s.parent else None,
                s.start_time,
                s.end_time,
                dict(s.attributes or {}),
            )
        )
    return out


def render(spans: list[SpanRecord], root: SpanRecord, keys: tuple[str, ...] = ()) -> str:
    """The tree under ``root``: one line per span, start offset and duration in ms, children by start time."""
    children: dict[str, list[SpanRecord]] = {}
    for s in spans:
        if s.parent_id is not None:
            children.setdefault(s.parent_id, []).append(s)
    lines: list[str] = []

    def walk(s: SpanRecord, depth: int) -> None:
        shown = {k: s.attributes[k] for k in keys if k in s.attributes}
        extra = "  " + " ".join(f"{k}={v}" for k, v in shown.items()) if shown else ""
        lines.append(
            f"{'  ' * depth}{s.service}: {s.name}  +{(s.start_ns - root.start_ns) / 1e6:.1f} ms  {s.ms:.1f} ms{extra}"
        )
        for c in sorted(children.get(s.span_id, []), key=lambda c: c.start_ns):
            walk(c, depth + 1)

    walk(root, 0)
    return "\n".join(lines)
