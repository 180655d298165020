"""The serving metrics (Prometheus), vLLM-compatible in meaning, on their own registry.

Pool and queue gauges are read from the engine at scrape time, so they are never stale.
"""

from __future__ import annotations

from collections.abc import Callable

import prometheus_client as prom

# Latency buckets in seconds: the CPU reference runner is slow, a GPU is fast; cover both.
LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _reader(stats: Callable[[], dict[str, int]], key: str) -> Callable[[], float]:
    return lambda: float(stats()[key])


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.started = prom.Counter("shinkai_requests_started", "requests queued to an engine", ["endpoint"],
                                    registry=r)
        self.finished = prom.Counter("shinkai_requests_finished", "requests ended, by finish reason", ["reason"],
                                     registry=r)
        self.rejected = prom.Counter("shinkai_requests_rejected", "requests refused before queueing", ["reason"],
                                     registry=r)
        self.routed = prom.Counter("shinkai_gateway_routed", "requests routed to each engine", ["engine"],
                                   registry=r)
        self.prompt_tokens = prom.Counter("shinkai_prompt_tokens", "prompt tokens of finished requests",
                                          registry=r)
        self.generation_tokens = prom.Counter("shinkai_generation_tokens", "output tokens of finished requests",
                                              registry=r)
        self.ttft = prom.Histogram("shinkai_time_to_first_token_seconds", "time to first token",
                                   buckets=LATENCY_BUCKETS, registry=r)
        self.itl = prom.Histogram("shinkai_inter_token_latency_seconds", "time between output tokens",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = prom.Histogram("shinkai_e2e_request_latency_seconds", "queueing to final output",
                                  buckets=LATENCY_BUCKETS, registry=r)

    def watch_engine(self, stats: Callable[[], dict[str, int]]) -> None:
        """Gauges of one engine's pools and queues, read at scrape time."""
        for key, help_text in (("num_running", "requests running"), ("num_waiting", "requests waiting"),
                               ("free_blocks", "free paged blocks"), ("total_blocks", "paged blocks"),
                               ("free_state_slots", "free state slots"), ("total_state_slots", "state slots")):
            gauge = prom.Gauge(f"shinkai_engine_{key}", help_text, registry=self.registry)
            gauge.set_function(_reader(stats, key))

    def exposition(self) -> bytes:
        return prom.generate_latest(self.registry)
