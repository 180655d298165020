"""The worker's ExecuteStep: a server span only under a traced step's context, and one step-time sample
per step either way."""

from types import SimpleNamespace

import pytest

import observability.metrics as names
from observability import tracing
from services.worker import service as worker_service
from tests.observability.otlp import from_sdk

TRACE, PARENT = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class _Context:
    def __init__(self, metadata) -> None:
        self.metadata = metadata

    def invocation_metadata(self):
        return self.metadata


@pytest.mark.parametrize("metadata", [(), (("traceparent", f"00-{TRACE}-{PARENT}-01"),)])
def test_execute_step_span_and_step_time(monkeypatch, metadata):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    monkeypatch.setattr(worker_service, "decode_plan", lambda request: (request, []))
    monkeypatch.setattr(worker_service, "encode_output", lambda out: out)
    worker = SimpleNamespace(execute=lambda plan, rows: SimpleNamespace(num_rows_computed=3))
    api = worker_service.WorkerApi(worker, "tiny", ("c", "w"), 10)
    exporter = InMemorySpanExporter()
    tracing.setup("shinkai-worker", exporter)
    try:
        api.ExecuteStep(object(), _Context(metadata))
    finally:
        tracing.disable()
    assert api.registry.get_sample_value(names.WORKER_STEP_SECONDS + "_count") == 1.0
    assert api.registry.get_sample_value(names.WORKER_STEPS + "_total") == 1.0
    spans = from_sdk(exporter.get_finished_spans())
    if metadata:
        (span,) = spans
        assert (span.name, span.trace_id, span.parent_id) == ("worker.execute_step", TRACE, PARENT)
    else:
        assert spans == []
