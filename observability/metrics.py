"""Every Prometheus metric name of Shinkai, defined once, and the metric sets the services register.

Semantics follow vLLM's (`vllm:time_to_first_token_seconds` and friends) under the ``shinkai_`` prefix;
the four gauges llm-d's router reads are also offered under their vLLM names. Each set registers on a
registry its owner passes in (one per process endpoint), so tests never share a global registry.

Invariants:
- A name appears in this module only; services import the constant or the set, never spell the name.
- Pool, queue and KV-usage gauges are read from the engine's stats at scrape time, so they are never stale.
- A histogram's ``_count`` moves once per request that reached the point it measures (TTFT: the first
  token; queue time: the first scheduled step; prefill: the first token; decode and e2e: the final output).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import prometheus_client as prom

# ---- names ---------------------------------------------------------------------------------------------

# Per request, measured where the request enters the service that exposes them (gateway: HTTP/gRPC arrival).
REQUESTS_STARTED = "shinkai_requests_started"
REQUESTS_FINISHED = "shinkai_requests_finished"  # label reason: stop | length | abort | preempted | error
REQUESTS_REJECTED = "shinkai_requests_rejected"
PROMPT_TOKENS = "shinkai_prompt_tokens"
GENERATION_TOKENS = "shinkai_generation_tokens"
TTFT = "shinkai_time_to_first_token_seconds"
ITL = "shinkai_inter_token_latency_seconds"
E2E = "shinkai_e2e_request_latency_seconds"
GATEWAY_ROUTED = "shinkai_gateway_routed"

# The supervisor of a `shinkai up` stack (services/entrypoints/supervisor.py), label service.
SUPERVISOR_CRASHES = "shinkai_supervisor_crashes"  # a service found gone
SUPERVISOR_RESTARTS = "shinkai_supervisor_restarts"  # a service started again
SUPERVISOR_GAVE_UP = "shinkai_supervisor_gave_up"  # 1: crashed past its restart limit, left down
SUPERVISOR_SERVICE_UP = "shinkai_supervisor_service_up"  # 1: running and healthy

# Engine: phases of a request inside one engine (vLLM's request_queue/prefill/decode_time_seconds).
QUEUE_TIME = "shinkai_request_queue_time_seconds"  # submitted → first scheduled step starts
PREFILL_TIME = "shinkai_request_prefill_time_seconds"  # first scheduled step starts → first token out
DECODE_TIME = "shinkai_request_decode_time_seconds"  # first token out → final output
ENGINE_STEPS = "shinkai_engine_steps"  # label kind: prefill | decode | placeholder
PLACEHOLDER_STEPS = "shinkai_engine_placeholder_steps"
PREEMPTIONS = "shinkai_engine_preemptions"
ABORTS = "shinkai_engine_aborts"  # label phase: waiting | prefill | decode
KV_USAGE = "shinkai_engine_kv_usage"  # label pool: blocks | state_slots; 1 - free / total
ENGINE_STAT_PREFIX = "shinkai_engine_"  # + num_running, num_waiting, free_blocks, total_blocks, ...
ENGINE_STATS = (
    ("num_running", "requests running"),
    ("num_waiting", "requests waiting"),
    ("free_blocks", "free paged blocks"),
    ("total_blocks", "paged blocks"),
    ("free_state_slots", "free state slots"),
    ("total_state_slots", "state slots"),
)

# The llm-d router's four, under vLLM's names (label model_name, as vLLM has it).
VLLM_RUNNING = "vllm:num_requests_running"
VLLM_WAITING = "vllm:num_requests_waiting"
VLLM_KV_USAGE = "vllm:kv_cache_usage_perc"  # a fraction in [0, 1], as vLLM reports it
VLLM_CACHE_CONFIG = "vllm:cache_config_info"
# What vLLM clients (aiperf, dashboards) read from a front end, beside the shinkai_ names of the same samples.
VLLM_TTFT = "vllm:time_to_first_token_seconds"
VLLM_ITL = "vllm:inter_token_latency_seconds"
VLLM_E2E = "vllm:e2e_request_latency_seconds"
VLLM_PROMPT_TOKENS = "vllm:prompt_tokens"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens"
VLLM_REQUEST_SUCCESS = "vllm:request_success"  # labels model_name, finished_reason: requests ended, as vLLM's
# The prefix cache, in prompt tokens (vLLM's counters): looked up at admission, and of those found cached.
PREFIX_CACHE_QUERIES = "shinkai_engine_prefix_cache_queries"
PREFIX_CACHE_HITS = "shinkai_engine_prefix_cache_hits"
VLLM_PREFIX_CACHE_QUERIES = "vllm:prefix_cache_queries"
VLLM_PREFIX_CACHE_HITS = "vllm:prefix_cache_hits"

# Tokenizer, worker and EPLB planner processes.
TOKENIZER_CALLS = "shinkai_tokenizer_calls"
WORKER_STEPS = "shinkai_worker_steps"
WORKER_ROWS = "shinkai_worker_rows_computed"
WORKER_STEP_SECONDS = "shinkai_worker_step_seconds"
MOE_LB = "shinkai_eplb_moe_lb"  # label layer; set only once the planner has expert-load data
EPLB_PUBLISHED = "shinkai_eplb_plans_published"
EPLB_REJECTED = "shinkai_eplb_plans_rejected"
EPLB_REPORTS = "shinkai_eplb_load_reports"
EPLB_BAD = "shinkai_eplb_bad_messages"
EPLB_REPLAN_SECONDS = "shinkai_eplb_replan_seconds"
MULTIMODAL_IMAGES_ENCODED = "shinkai_multimodal_images_encoded"  # images the vision tower ran on (cache misses)
MULTIMODAL_ENCODE_SECONDS = "shinkai_multimodal_encode_seconds"  # per tower batch: preprocessed images → spans
MULTIMODAL_BATCH_IMAGES = "shinkai_multimodal_batch_images"  # images per tower batch
MULTIMODAL_CACHE_HITS = "shinkai_multimodal_cache_hits"  # Encode calls answered from the content-hash cache

# Latency buckets in seconds: the CPU reference runner is slow, a GPU is fast; cover both.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


# ---- sets ----------------------------------------------------------------------------------------------


class _Both:
    """One sample recorded under its shinkai_ name and its vLLM name (labelled with the served model)."""

    def __init__(
        self, own: prom.Histogram | prom.Counter, vllm: prom.Histogram | prom.Counter, metrics: RequestMetrics
    ) -> None:
        self.own, self.vllm, self.metrics = own, vllm, metrics

    def observe(self, value: float) -> None:
        self.own.observe(value)
        self.vllm.labels(model_name=self.metrics.model_name).observe(value)

    def inc(self, value: float = 1) -> None:
        self.own.inc(value)
        self.vllm.labels(model_name=self.metrics.model_name).inc(value)


class RequestMetrics:
    """What a front end (gateway, `shinkai serve`, an engine's own API) sees of each request, on the
    process endpoint's registry (a fresh one unless given; `EngineMetrics` may share it). Latencies and token
    counts are also exported under vLLM's names, where vLLM clients look."""

    def __init__(self, registry: prom.CollectorRegistry | None = None) -> None:
        self.registry = r = registry if registry is not None else prom.CollectorRegistry()
        self.model_name = ""  # the vLLM names' model_name label; the front end sets the served name
        self.started = prom.Counter(REQUESTS_STARTED, "requests queued to an engine", ["endpoint"], registry=r)
        self.finished = prom.Counter(REQUESTS_FINISHED, "requests ended, by finish reason", ["reason"], registry=r)
        self.rejected = prom.Counter(REQUESTS_REJECTED, "requests refused before queueing", ["reason"], registry=r)
        self.routed = prom.Counter(GATEWAY_ROUTED, "requests routed to each engine", ["engine"], registry=r)
        model = ["model_name"]

        def counter(name: str, vllm_name: str, help_text: str) -> _Both:
            return _Both(
                prom.Counter(name, help_text, registry=r),
                prom.Counter(vllm_name, help_text + " (vLLM name)", model, registry=r),
                self,
            )

        def histogram(name: str, vllm_name: str, help_text: str) -> _Both:
            return _Both(
                prom.Histogram(name, help_text, buckets=LATENCY_BUCKETS, registry=r),
                prom.Histogram(vllm_name, help_text + " (vLLM name)", model, buckets=LATENCY_BUCKETS, registry=r),
                self,
            )

        self.prompt_tokens = counter(PROMPT_TOKENS, VLLM_PROMPT_TOKENS, "prompt tokens of finished requests")
        self.generation_tokens = counter(
            GENERATION_TOKENS, VLLM_GENERATION_TOKENS, "output tokens of finished requests"
        )
        self.request_success = prom.Counter(
            VLLM_REQUEST_SUCCESS,
            "requests ended, by finish reason (vLLM name)",
            ["model_name", "finished_reason"],
            registry=r,
        )
        self.ttft = histogram(TTFT, VLLM_TTFT, "arrival to first output token")
        self.itl = histogram(ITL, VLLM_ITL, "time between output tokens")
        self.e2e = histogram(E2E, VLLM_E2E, "arrival to final output")

    def count_finished(self, reason: str) -> None:
        """One request ended with this finish reason: shinkai_requests_finished and vllm:request_success."""
        self.finished.labels(reason=reason).inc()
        self.request_success.labels(model_name=self.model_name, finished_reason=reason).inc()

    def exposition(self) -> bytes:
        """The text format of everything on the registry (engine metrics included when they share it)."""
        return prom.generate_latest(self.registry)


def _usage(stats: Callable[[], Any], pool: str) -> Callable[[], float]:
    def read() -> float:
        s = stats()
        total = getattr(s, f"total_{pool}")
        return 1.0 - getattr(s, f"free_{pool}") / total if total else 0.0

    return read


def _stat(stats: Callable[[], Any], key: str) -> Callable[[], float]:
    return lambda: float(getattr(stats(), key))


class _PrefixCacheCounters:
    """The engine's prefix-cache token counts (cumulative in its scheduler) as counters, read at scrape time,
    under the shinkai_ names and vLLM's (label model_name)."""

    def __init__(self, stats: Callable[[], Any], model_name: str) -> None:
        self.stats = stats
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        s = self.stats()
        for key, own, vllm, help_text in (
            ("prefix_cache_queries", PREFIX_CACHE_QUERIES, VLLM_PREFIX_CACHE_QUERIES, "prompt tokens looked up"),
            ("prefix_cache_hits", PREFIX_CACHE_HITS, VLLM_PREFIX_CACHE_HITS, "prompt tokens found in the prefix cache"),
        ):
            value = float(getattr(s, key))
            yield CounterMetricFamily(own, help_text, value=value)
            family = CounterMetricFamily(vllm, help_text + " (vLLM name)", labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class EngineMetrics:
    """One engine replica: request phases, steps, preemptions, aborts, and its pools read at scrape time.

    ``stats`` returns the engine's counts (an `EngineStats`: services/engine/stats.py, read by attribute name,
    since this package imports nothing from services); ``cache_config`` the fixed pool sizes
    for `vllm:cache_config_info` (its value is always 1, the information is in the labels).
    """

    def __init__(
        self,
        registry: prom.CollectorRegistry,
        stats: Callable[[], Any],
        model_name: str,
        cache_config: Mapping[str, object],
    ) -> None:
        r = registry
        self.queue_time = prom.Histogram(
            QUEUE_TIME, "submitted to first scheduled step", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prefill_time = prom.Histogram(
            PREFILL_TIME, "first scheduled step to first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.decode_time = prom.Histogram(
            DECODE_TIME, "first token to final output", buckets=LATENCY_BUCKETS, registry=r
        )
        self.steps = prom.Counter(ENGINE_STEPS, "engine steps by kind", ["kind"], registry=r)
        self.placeholder_steps = prom.Counter(PLACEHOLDER_STEPS, "steps run with no real rows", registry=r)
        self.preemptions = prom.Counter(PREEMPTIONS, "requests preempted", registry=r)
        self.aborts = prom.Counter(ABORTS, "requests aborted, by the phase they were in", ["phase"], registry=r)
        for key, help_text in ENGINE_STATS:
            prom.Gauge(ENGINE_STAT_PREFIX + key, help_text, registry=r).set_function(_stat(stats, key))
        kv = prom.Gauge(KV_USAGE, "fraction of a pool in use", ["pool"], registry=r)
        for pool in ("blocks", "state_slots"):
            kv.labels(pool=pool).set_function(_usage(stats, pool))
        model = {"model_name": model_name}
        prom.Gauge(VLLM_RUNNING, "requests running (vLLM name)", list(model), registry=r).labels(**model).set_function(
            _stat(stats, "num_running")
        )
        prom.Gauge(VLLM_WAITING, "requests waiting (vLLM name)", list(model), registry=r).labels(**model).set_function(
            _stat(stats, "num_waiting")
        )
        # Either pool refuses admission when it is full, so the router sees the fuller one.
        blocks, slots = _usage(stats, "blocks"), _usage(stats, "state_slots")
        prom.Gauge(VLLM_KV_USAGE, "KV cache usage, the fuller pool (vLLM name)", list(model), registry=r).labels(
            **model
        ).set_function(lambda: max(blocks(), slots()))
        r.register(_PrefixCacheCounters(stats, model_name))
        info = {k: str(v) for k, v in cache_config.items()}
        prom.Gauge(VLLM_CACHE_CONFIG, "cache configuration (vLLM name)", list(info), registry=r).labels(**info).set(1)


class EngineLoadsCollector:
    """The gateway's view of its engines under vLLM's gauge names, summed over engines from their latest
    load reports (`reports` returns one `EngineStats` per engine that has reported):
    running and waiting are sums; KV usage is the fuller pool's used fraction of all engines' capacity."""

    def __init__(self, reports: Callable[[], list[Any]], model_name: str) -> None:
        self.reports = reports
        self.model_name = model_name

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        reports = self.reports()

        def total(key: str) -> float:
            return float(sum(getattr(r, key) for r in reports))

        usage = 0.0
        for pool in ("blocks", "state_slots"):
            capacity = total(f"total_{pool}")
            if capacity:
                usage = max(usage, 1.0 - total(f"free_{pool}") / capacity)
        for name, help_text, value in (
            (VLLM_RUNNING, "requests running, all engines (vLLM name)", total("num_running")),
            (VLLM_WAITING, "requests waiting, all engines (vLLM name)", total("num_waiting") + total("num_queued")),
            (VLLM_KV_USAGE, "KV cache usage, all engines (vLLM name)", usage),
        ):
            family = GaugeMetricFamily(name, help_text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family
