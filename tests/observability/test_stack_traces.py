"""`shinkai up` with tracing on: every process exports over real OTLP/gRPC to a receiver this test runs.

One HTTP request gives spans from the gateway, the tokenizer and the engine under one trace id, with the
parent links of the call chain; a traced engine step has the worker's span (gRPC metadata) and the EPLB
planner's (NATS headers) under it, in its own trace; gateway and engine /metrics count the requests sent."""

import json
import re
import time
import urllib.request

import pytest

from services.entrypoints.stack import down, up
from services.entrypoints.stack_config import StackConfig
from tests.observability.otlp import otlp_receiver, render
from tests.service_logs import ready_event

pytestmark = pytest.mark.timeout(180)

NUM_REQUESTS = 2


def _complete(url: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "seed": 3}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def _scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return r.read().decode()


def _value(text: str, sample: str) -> float:
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.M)
    assert m, f"{sample} not in /metrics"
    return float(m.group(1))


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("traced-stack")
    with otlp_receiver() as receiver, pytest.MonkeyPatch.context() as env:
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # ms: batches leave promptly, no shutdown needed
        env.setenv("SHINKAI_TRACE_STEPS_EVERY", "1")
        config = StackConfig(
            num_engines=1, http_port=0, grpc_port=0, run_dir=run_dir, max_num_seqs=4, remote_workers=True
        )
        state = up(config, timeout_s=120, log=lambda *_: None)
        try:
            by_name = {s["name"]: s for s in state["services"]}
            ready = ready_event(by_name["gateway"]["log"])
            yield receiver, by_name, ready
        finally:
            down(run_dir, timeout_s=30, log=lambda *_: None)


def test_one_request_traced_across_processes(traced_stack):
    receiver, by_name, ready = traced_stack
    out = _complete(ready["http"], "Hello", 3)
    assert out["usage"]["completion_tokens"] == 3

    def complete(spans):
        names = {(s.service, s.name) for s in spans}
        return {
            ("shinkai-gateway", "request"),
            ("shinkai-engine", "decode"),
            ("shinkai-tokenizer", "tokenizer.Detokenize"),
            ("shinkai-worker", "worker.execute_step"),
            ("shinkai-eplb", "eplb.load_report"),
        } <= names

    spans = receiver.wait_for(complete)
    (root,) = [s for s in spans if s.service == "shinkai-gateway" and s.name == "request"]
    assert root.parent_id is None
    tree = [s for s in spans if s.trace_id == root.trace_id]
    by = {(s.service, s.name): s for s in tree}
    assert {s.service for s in tree} >= {"shinkai-gateway", "shinkai-tokenizer", "shinkai-engine"}

    def parent(child: tuple[str, str], of: tuple[str, str]) -> None:
        assert by[child].parent_id == by[of].span_id, f"{child} is not under {of}"

    parent(("shinkai-gateway", "tokenize"), ("shinkai-gateway", "request"))
    parent(("shinkai-tokenizer", "tokenizer.Encode"), ("shinkai-gateway", "tokenize"))
    parent(("shinkai-engine", "request"), ("shinkai-gateway", "request"))
    for phase in ("queue", "prefill", "decode"):
        parent(("shinkai-engine", phase), ("shinkai-engine", "request"))
    parent(("shinkai-gateway", "detokenize"), ("shinkai-gateway", "request"))
    parent(("shinkai-tokenizer", "tokenizer.Detokenize"), ("shinkai-gateway", "detokenize"))
    assert by[("shinkai-engine", "decode")].attributes["request.output_tokens"] == 3

    # Engine steps: their own traces, the worker's ExecuteStep span under each (context in gRPC metadata).
    steps = {s.span_id: s for s in spans if s.name == "engine.step"}
    workers = [s for s in spans if s.name == "worker.execute_step"]
    assert steps and workers and all(w.parent_id in steps for w in workers)
    step = steps[workers[0].parent_id]
    assert workers[0].trace_id == step.trace_id != root.trace_id
    # The step's expert-load report reached the planner over NATS with the step's context in its headers.
    reports = [s for s in spans if s.name == "eplb.load_report"]
    assert reports and all(r.parent_id in steps and r.trace_id == steps[r.parent_id].trace_id for r in reports)
    print("\n" + render(spans, root, ("request.finish_reason", "request.output_tokens")))
    print(render(spans, step, ("engine.phase", "engine.batch_size", "engine.rows", "engine.graph_size")))


def test_metrics_of_gateway_and_engine_count_the_requests(traced_stack):
    _, by_name, ready = traced_stack
    engine_url = by_name["engine-0"]["url"].removeprefix("metrics ")
    before_gw, before_engine = _scrape(ready["http"] + "/metrics"), _scrape(engine_url)
    outs = [_complete(ready["http"], f"Count me {i}", 2) for i in range(NUM_REQUESTS)]
    gw, engine = _scrape(ready["http"] + "/metrics"), _scrape(engine_url)

    def grew(before: str, after: str, sample: str) -> float:
        return _value(after, sample) - (_value(before, sample) if sample.split(" ")[0] in before else 0.0)

    for name in (
        "shinkai_time_to_first_token_seconds_count",
        "shinkai_e2e_request_latency_seconds_count",
        'shinkai_requests_finished_total{reason="length"}',
    ):
        assert grew(before_gw, gw, name) == NUM_REQUESTS, name
    assert grew(before_gw, gw, "shinkai_generation_tokens_total") == 2 * NUM_REQUESTS
    assert grew(before_gw, gw, "shinkai_prompt_tokens_total") == sum(o["usage"]["prompt_tokens"] for o in outs)
    for name in (
        "shinkai_request_queue_time_seconds_count",
        "shinkai_request_prefill_time_seconds_count",
        "shinkai_request_decode_time_seconds_count",
    ):
        assert grew(before_engine, engine, name) == NUM_REQUESTS, name
    deadline = time.monotonic() + 5
    while _value(_scrape(engine_url), 'vllm:num_requests_running{model_name="tiny"}') and time.monotonic() < deadline:
        time.sleep(0.05)
    engine = _scrape(engine_url)
    assert _value(engine, 'vllm:num_requests_running{model_name="tiny"}') == 0
    assert _value(engine, 'vllm:kv_cache_usage_perc{model_name="tiny"}') == 0
    assert re.search(r'^vllm:cache_config_info\{.*block_size="128".*\} 1\.0$', engine, re.M)
