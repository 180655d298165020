"""OpenTelemetry tracing for every Shinkai process: setup, W3C context in gRPC metadata and NATS headers, spans.

A process calls ``setup(service_name)`` once at start. Tracing is on only when ``OTEL_EXPORTER_OTLP_ENDPOINT``
is set (spans go out over OTLP/gRPC in batches; ``OTEL_BSP_SCHEDULE_DELAY`` and the other standard OTel
variables apply) or when a test passes its own exporter.

Invariants:
- Off means free: every helper checks one module global and returns None (or does nothing) before it
  touches OpenTelemetry, so a request allocates no span, context or carrier; call sites keep that by
  passing what these helpers return straight through (a None span, None metadata, None context).
- The tracer provider is this module's own, never OTel's global one, so tests can switch tracing on and off
  within one process (`setup` replaces it, `disable` turns it off) and nothing else can turn it on by accident.
- Context travels as W3C ``traceparent``/``tracestate``: in gRPC metadata (gateway → tokenizer, gateway →
  engine, engine → worker), in NATS message headers, and is read from HTTP request headers at the gateway.
- Engine steps are traced 1 in ``step_sample_every`` (env ``SHINKAI_TRACE_STEPS_EVERY``, default 100; 0: none).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from typing import Any, ContextManager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
STEPS_EVERY_ENV = "SHINKAI_TRACE_STEPS_EVERY"
DEFAULT_STEPS_EVERY = 100

_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # None: tracing is off
_provider: Any = None  # the SDK TracerProvider behind _tracer
step_sample_every = 0  # trace engine step k when k % step_sample_every == 0; 0: never


def setup(service_name: str, exporter: Any = None, *, steps_every: int | None = None) -> bool:
    """Turns tracing on for this process if ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set or ``exporter`` is given
    (exported span by span, for tests). Returns whether tracing is on."""
    global _tracer, _provider, step_sample_every
    if exporter is None and not os.environ.get(ENDPOINT_ENV):
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        processor: Any = BatchSpanProcessor(OTLPSpanExporter())  # endpoint and options from the OTEL_* env
    else:
        processor = SimpleSpanProcessor(exporter)
    disable()
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))  # flushes at exit
    provider.add_span_processor(processor)
    _provider, _tracer = provider, provider.get_tracer("shinkai")
    step_sample_every = (
        steps_every if steps_every is not None else int(os.environ.get(STEPS_EVERY_ENV, DEFAULT_STEPS_EVERY))
    )
    return True


def disable() -> None:
    """Flushes and turns tracing off (spans still open are dropped)."""
    global _tracer, _provider, step_sample_every
    provider, _provider, _tracer, step_sample_every = _provider, None, None, 0
    if provider is not None:
        provider.shutdown()


def enabled() -> bool:
    return _tracer is not None


def sample_step(step_number: int) -> bool:
    """Whether the engine step with this number gets a span."""
    return _tracer is not None and step_sample_every > 0 and step_number % step_sample_every == 0


# ---- spans -----------------------------------------------------------------------------------------------


def start_span(
    name: str,
    parent: Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    *,
    start_ns: int | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
) -> Span | None:
    """A started span, child of ``parent`` (or of the current span when ``parent`` is None); None when off."""
    if _tracer is None:
        return None
    return _tracer.start_span(name, context=parent, kind=kind, attributes=attributes, start_time=start_ns)


def end(
    span: Span | None, attributes: Mapping[str, Any] | None = None, error: str | None = None, end_ns: int | None = None
) -> None:
    if span is None:
        return
    if attributes:
        span.set_attributes(attributes)
    if error is not None:
        span.set_status(Status(StatusCode.ERROR, error))
    span.end(end_time=end_ns)


def record(
    name: str, parent: Context | None, start_ns: int, end_ns: int, attributes: Mapping[str, Any] | None = None
) -> None:
    """A finished span from times taken earlier (the engine's queue, prefill and decode phases)."""
    if _tracer is not None:
        _tracer.start_span(name, context=parent, attributes=attributes, start_time=start_ns).end(end_time=end_ns)


_NOTHING: contextlib.nullcontext[None] = contextlib.nullcontext()  # reusable: off costs no allocation


def active(span: Span | None) -> ContextManager[Span | None]:
    """Makes ``span`` current for the block (calls in it carry its context); ends nothing."""
    if span is None:
        return _NOTHING
    return trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False)


def span(
    name: str,
    parent: Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    *,
    kind: SpanKind = SpanKind.INTERNAL,
) -> ContextManager[Span | None]:
    """A current span for the block, ended on exit (with ERROR status if the block raises)."""
    if _tracer is None:
        return _NOTHING
    return _tracer.start_as_current_span(name, context=parent, kind=kind, attributes=attributes)


def context_of(span: Span | None) -> Context | None:
    """A context whose current span is ``span`` (a parent to hand to another thread); None when off."""
    return trace.set_span_in_context(span) if span is not None else None


def current_context() -> Context | None:
    """The calling task's or thread's context, to parent spans made elsewhere; None when off."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def trace_id(span: Span | None) -> str | None:
    return format(span.get_span_context().trace_id, "032x") if span is not None else None


# ---- propagation -----------------------------------------------------------------------------------------


def grpc_metadata(parent: Context | None = None) -> tuple[tuple[str, str], ...] | None:
    """gRPC call metadata carrying the current (or ``parent``) context; None when off."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=parent)
    return tuple(carrier.items()) or None


def nats_headers(parent: Context | None = None) -> dict[str, str] | None:
    """NATS message headers carrying the current (or ``parent``) context; None when off."""
    if _tracer is None:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=parent)
    return carrier or None


def extract(carrier: Mapping[str, str] | Iterable[tuple[str, Any]] | None) -> Context | None:
    """The remote parent in gRPC invocation metadata, NATS headers or HTTP headers; None when off or absent."""
    if _tracer is None or carrier is None:
        return None
    pairs = carrier.items() if isinstance(carrier, Mapping) else carrier
    found = {
        str(k).lower(): v if isinstance(v, str) else v.decode()
        for k, v in pairs
        if str(k).lower() in ("traceparent", "tracestate")
    }
    if "traceparent" not in found:
        return None
    return _PROPAGATOR.extract(found)
