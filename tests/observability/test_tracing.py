"""Tracing in one process (`shinkai serve`): a request's span tree, sampled engine steps, W3C context from an
HTTP caller and from gRPC metadata, and nothing at all when tracing is off."""

import json
import urllib.request

from observability import tracing
from tests.observability.otlp import from_sdk

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


def _complete(url: str, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def test_one_request_is_one_span_tree_under_the_callers_trace(served, memory_spans):
    steps_before = served.server.engine.num_steps
    out = _complete(
        served.http_url,
        {"model": "tiny", "prompt": "Hello there", "max_tokens": 3, "seed": 1},
        {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
    )
    assert out["usage"]["completion_tokens"] == 3
    spans = from_sdk(memory_spans.get_finished_spans())
    (request,) = [s for s in spans if s.name == "request"]
    assert (request.trace_id, request.parent_id) == (CALLER_TRACE, CALLER_SPAN)
    assert request.attributes["request.finish_reason"] == "length"
    # The prefix cache's hit, as the response reports it (the served engine is shared: an earlier test may have
    # sent the same prompt).
    cached = (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert request.attributes["request.cached_tokens"] == cached
    assert request.attributes["request.prompt_tokens"] == out["usage"]["prompt_tokens"]
    children = {s.name: s for s in spans if s.parent_id == request.span_id}
    assert set(children) == {"tokenize", "queue", "prefill", "decode", "detokenize"}
    assert all(s.trace_id == CALLER_TRACE for s in children.values())
    q, p, d = children["queue"], children["prefill"], children["decode"]
    # The phases tile the engine's part of the request: each starts where the previous one ended.
    assert request.start_ns <= children["tokenize"].end_ns <= q.start_ns <= q.end_ns == p.start_ns
    assert p.end_ns == d.start_ns <= d.end_ns <= request.end_ns
    assert d.attributes["request.output_tokens"] == 3
    steps = [s for s in spans if s.name == "engine.step"]
    # Sampled 1 in 1: one span per step, each its own trace, with the plan's shape.
    assert len(steps) == served.server.engine.num_steps - steps_before
    assert {s.attributes["engine.phase"] for s in steps} == {"prefill", "decode"}
    for s in steps:
        assert s.parent_id is None and s.trace_id != CALLER_TRACE
        assert s.attributes["engine.batch_size"] >= 1 and s.attributes["engine.rows"] >= 1
        assert s.attributes["engine.placeholder"] is False and "engine.graph_size" in s.attributes


def test_grpc_metadata_carries_the_context(served, memory_spans):
    with tracing.span("caller") as caller:
        metadata = tracing.grpc_metadata()
    assert metadata is not None and metadata[0][0] == "traceparent"
    _generate_raw(served.grpc_target, metadata)
    spans = from_sdk(memory_spans.get_finished_spans())
    (request,) = [s for s in spans if s.name == "request"]
    assert request.trace_id == tracing.trace_id(caller)
    assert request.parent_id == format(caller.get_span_context().span_id, "016x")


def _generate_raw(target: str, metadata) -> None:
    import grpc

    from services.proto.shinkai.v1 import shinkai_pb2 as pb
    from services.proto.shinkai.v1 import shinkai_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        request = pb.GenerateRequest(text="Hi", sampling=pb.SamplingParams(max_tokens=2))
        replies = list(shinkai_pb2_grpc.ShinkaiStub(channel).Generate(request, metadata=metadata, timeout=60))
    assert replies[-1].WhichOneof("kind") == "final"


def test_off_means_no_spans_and_no_carriers(served):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.setup("shinkai", exporter, steps_every=1)
    tracing.disable()  # its provider is shut down: a span made through it now would be dropped, not exported
    _complete(
        served.http_url,
        {"model": "tiny", "prompt": "Hello", "max_tokens": 2},
        {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"},
    )
    assert not tracing.enabled() and exporter.get_finished_spans() == ()
    assert tracing.grpc_metadata() is None and tracing.nats_headers() is None and tracing.current_context() is None
    assert (
        tracing.start_span("x") is None
        and tracing.extract({"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}) is None
    )
    assert all(not tracing.sample_step(k) for k in range(10))
