"""One in-process `shinkai serve` for the observability tests (tracing is switched per test)."""

import pytest

from observability import tracing
from services.gateway.server import ServeConfig
from tests.services.gateway.support import ServerThread, pools_whole


@pytest.fixture(scope="package")
def served():
    thread = ServerThread(
        ServeConfig(model="tiny", http_port=0, grpc_port=0, drain_timeout_s=10, engine_args={"max_num_seqs": 8})
    ).start()
    yield thread
    thread.stop()
    assert pools_whole(thread.server.engine.stats())


@pytest.fixture
def memory_spans():
    """Tracing on for one test, every span (engine steps included) into an in-memory exporter."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    assert tracing.setup("shinkai", exporter, steps_every=1)
    try:
        yield exporter
    finally:
        tracing.disable()
