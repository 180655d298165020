"""/metrics of one `shinkai serve`: every histogram, counter and gauge is there under its one name, and the
counts move by exactly the requests sent; aborts are counted by phase; the llm-d gauges under vLLM names."""

import json
import time
import urllib.request

import prometheus_client as prom
import pytest
from prometheus_client.parser import text_string_to_metric_families

import observability.metrics as names
from observability.metrics import EngineMetrics
from services.client import ShinkaiClient
from services.engine.finish_reason import FinishReason
from services.engine.reporting.observer import EngineObserver, RequestTimes
from services.engine.stats import EngineStats

NUM_REQUESTS = 3
MAX_TOKENS = 4


def _samples(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def _wait_idle(served) -> None:
    deadline = time.monotonic() + 10
    while served.server.engine.num_unfinished() and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.1)  # the step thread's stats snapshot follows its last step


def test_counts_match_the_requests_sent(served):
    _wait_idle(served)
    steps_before = served.server.engine.num_steps
    before = _samples(served.http_url)
    prompt_tokens = 0
    for i in range(NUM_REQUESTS):
        body = json.dumps(
            {"model": "tiny", "prompt": f"Tell me {i}", "max_tokens": MAX_TOKENS, "seed": i, "ignore_eos": True}
        ).encode()
        req = urllib.request.Request(served.http_url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            prompt_tokens += json.load(r)["usage"]["prompt_tokens"]
    _wait_idle(served)
    after = _samples(served.http_url)

    def grew(name: str, **labels: str) -> float:
        return _get(after, name, **labels) - _get(before, name, **labels)

    for hist in (names.TTFT, names.E2E, names.QUEUE_TIME, names.PREFILL_TIME, names.DECODE_TIME):
        assert grew(hist + "_count") == NUM_REQUESTS, hist
        assert grew(hist + "_bucket", le="+Inf") == NUM_REQUESTS, hist
        assert grew(hist + "_sum") > 0, hist
    # One inter-token latency per output token after the first, as vLLM counts them.
    assert grew(names.ITL + "_count") == NUM_REQUESTS * (MAX_TOKENS - 1)
    assert grew(names.REQUESTS_FINISHED + "_total", reason="length") == NUM_REQUESTS
    success = names.VLLM_REQUEST_SUCCESS + "_total"  # vLLM's counter, which its dashboards read
    assert grew(success, model_name="tiny", finished_reason="length") == NUM_REQUESTS
    assert grew(names.REQUESTS_STARTED + "_total", endpoint="completions") == NUM_REQUESTS
    assert grew(names.GENERATION_TOKENS + "_total") == NUM_REQUESTS * MAX_TOKENS
    assert grew(names.PROMPT_TOKENS + "_total") == prompt_tokens
    num_steps = served.server.engine.num_steps - steps_before
    assert (
        num_steps
        and sum(grew(names.ENGINE_STEPS + "_total", kind=k) for k in ("prefill", "decode", "placeholder")) == num_steps
    )
    stats = served.server.engine.stats()
    model = {"model_name": "tiny"}
    assert _get(after, names.VLLM_RUNNING, **model) == _get(after, names.ENGINE_STAT_PREFIX + "num_running") == 0
    assert _get(after, names.VLLM_WAITING, **model) == 0
    assert _get(after, names.ENGINE_STAT_PREFIX + "total_blocks") == stats.total_blocks > 0
    assert _get(after, names.KV_USAGE, pool="blocks") == _get(after, names.VLLM_KV_USAGE, **model) == 0.0
    info = [labels for (name, labels) in after if name == names.VLLM_CACHE_CONFIG]
    assert len(info) == 1 and dict(info[0])["num_gpu_blocks"] == str(stats.total_blocks)
    assert _get(after, names.VLLM_CACHE_CONFIG, **dict(info[0])) == 1.0


def test_the_vllm_names_are_the_ones_llm_d_reads():
    assert (names.VLLM_RUNNING, names.VLLM_WAITING, names.VLLM_KV_USAGE, names.VLLM_CACHE_CONFIG) == (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
    )


def test_kv_usage_moves_while_a_request_runs(served):
    _wait_idle(served)
    with ShinkaiClient(served.grpc_target, timeout=60) as c:
        stream = c.generate_stream("Hello", max_tokens=1000, ignore_eos=True, client_request_id="obs-abort")
        assert next(stream).finish_reason is None
        time.sleep(0.1)
        during = _samples(served.http_url)
        assert _get(during, names.VLLM_RUNNING, model_name="tiny") == 1
        assert (
            0
            < _get(during, names.KV_USAGE, pool="state_slots")
            <= _get(during, names.VLLM_KV_USAGE, model_name="tiny")
            <= 1
        )
        before = _get(during, names.ABORTS + "_total", phase="decode")
        assert c.abort("obs-abort") is True
        for _ in stream:
            pass
    _wait_idle(served)
    assert _get(_samples(served.http_url), names.ABORTS + "_total", phase="decode") == before + 1


@pytest.mark.parametrize("scheduled, first_token, phase", [(0, 0, "waiting"), (1, 0, "prefill"), (1, 1, "decode")])
def test_aborts_are_counted_once_by_phase(scheduled, first_token, phase):
    registry = prom.CollectorRegistry()
    stats = EngineStats(
        free_blocks=9,
        total_blocks=10,
        free_state_slots=3,
        total_state_slots=4,
        num_waiting=0,
        num_running=0,
        decode_step=0,
    )
    observer = EngineObserver(EngineMetrics(registry, lambda: stats, "m", {"block_size": 128}))
    t = RequestTimes(submitted=1, scheduled=scheduled, first_token=first_token)
    observer.finished(t, FinishReason.ABORT, 0)
    observer.finished(RequestTimes(submitted=1), FinishReason.PREEMPTED, 0)
    got = {
        p: registry.get_sample_value(names.ABORTS + "_total", {"phase": p}) or 0.0
        for p in ("waiting", "prefill", "decode")
    }
    assert got == {p: 1.0 if p == phase else 0.0 for p in got}
    assert registry.get_sample_value(names.PREEMPTIONS + "_total") == 1.0
    assert registry.get_sample_value(names.DECODE_TIME + "_count") == (1.0 if first_token else 0.0)
    # The fuller pool is what the router sees: state slots at 1/4 over blocks at 1/10.
    assert registry.get_sample_value(names.VLLM_KV_USAGE, {"model_name": "m"}) == pytest.approx(0.25)


def test_engine_loads_collector_sums_engines_under_vllm_names():
    from observability.metrics import EngineLoadsCollector

    reports = [
        EngineStats(
            num_running=2,
            num_waiting=1,
            num_queued=1,
            free_blocks=30,
            total_blocks=40,
            free_state_slots=3,
            total_state_slots=4,
            decode_step=0,
        ),
        EngineStats(
            num_running=3,
            num_waiting=0,
            num_queued=0,
            free_blocks=40,
            total_blocks=40,
            free_state_slots=1,
            total_state_slots=4,
            decode_step=0,
        ),
    ]
    registry = prom.CollectorRegistry()
    registry.register(EngineLoadsCollector(lambda: reports, "tiny"))
    value = lambda name: registry.get_sample_value(name, {"model_name": "tiny"})  # noqa: E731
    assert value(names.VLLM_RUNNING) == 5 and value(names.VLLM_WAITING) == 2
    assert value(names.VLLM_KV_USAGE) == pytest.approx(0.5)  # state slots: 4 of 8 in use; blocks only 10 of 80
    reports.clear()
    assert value(names.VLLM_RUNNING) == 0 and value(names.VLLM_KV_USAGE) == 0
