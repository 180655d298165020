"""What an `EngineService` reports about its requests and steps: phase times, step counts, spans.

Runs on the step thread only (the service calls it from there), so it needs no lock of its own.

Invariants:
- A request's phases are submitted → scheduled (queue) → first token (prefill) → final (decode); each
  time is taken once, the first time it happens, and a phase that never started has no span and no
  histogram sample (an abort while waiting has a queue span ending at the abort and nothing else).
- An abort is counted once, under the phase the request was in: waiting, prefill or decode.
- Spans of a request are children of the context that submitted it (the engine's request span), recorded
  after the fact from the times above; with tracing off there is no context and nothing is recorded.
- Step spans exist only for sampled steps (`observability.tracing.sample_step`), started before the step so
  the worker call made inside carries their context.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from observability import tracing
from observability.metrics import EngineMetrics
from services.engine.finish_reason import FinishReason


@dataclass(slots=True)
class RequestTimes:
    """Wall-clock nanoseconds of one request's phase boundaries (0: not yet)."""

    submitted: int
    parent: Any = None  # opentelemetry Context of the submitter, or None (tracing off)
    scheduled: int = 0
    first_token: int = 0


class EngineObserver:
    def __init__(self, metrics: EngineMetrics | None = None) -> None:
        self.metrics = metrics  # None: count nothing (an engine without an endpoint)
        self.num_steps = 0  # steps observed, the sampling index

    def submitted(self) -> RequestTimes:
        """Called on the submitting task, so its current span becomes the parent of the request's phases."""
        return RequestTimes(time.time_ns(), tracing.current_context())

    def step_started(self) -> Any:
        """The step's span if this step is sampled (make it current around the step), else None."""
        return tracing.start_span("engine.step") if tracing.sample_step(self.num_steps) else None

    def step_finished(self, plan: Any, started_ns: int, span: Any, times: Callable[[str], RequestTimes | None]) -> None:
        """``times``: engine request id → that request's times while it is live, else None."""
        self.num_steps += 1
        for request_id in plan.request_ids:
            t = times(request_id)
            if t is not None and not t.scheduled:
                t.scheduled = started_ns
                if self.metrics is not None:
                    self.metrics.queue_time.observe((started_ns - t.submitted) / 1e9)
        if self.metrics is not None:
            kind = "placeholder" if plan.is_placeholder else plan.kind
            self.metrics.steps.labels(kind=kind).inc()
            if plan.is_placeholder:
                self.metrics.placeholder_steps.inc()
        if span is not None:
            tracing.end(
                span,
                {
                    "engine.step": self.num_steps - 1,
                    "engine.batch_size": plan.num_requests,
                    "engine.phase": plan.kind,
                    "engine.placeholder": plan.is_placeholder,
                    "engine.rows": plan.num_rows,
                    "engine.padding_rows": plan.num_padding_rows,
                    "engine.graph_size": plan.graph_size if plan.graph_size is not None else 0,
                },
            )

    def tokens(self, t: RequestTimes) -> None:
        """The request's delta carried tokens."""
        if t.first_token:
            return
        t.first_token = time.time_ns()
        if self.metrics is not None and t.scheduled:
            self.metrics.prefill_time.observe((t.first_token - t.scheduled) / 1e9)

    def finished(self, t: RequestTimes, reason: FinishReason, num_output_tokens: int) -> None:
        now = time.time_ns()
        m = self.metrics
        if m is not None:
            if t.first_token:
                m.decode_time.observe((now - t.first_token) / 1e9)
            if reason == FinishReason.PREEMPTED:
                m.preemptions.inc()
            if reason == FinishReason.ABORT:
                m.aborts.labels(phase="decode" if t.first_token else "prefill" if t.scheduled else "waiting").inc()
        if t.parent is None:
            return
        queue_end = t.scheduled or now
        tracing.record("queue", t.parent, t.submitted, queue_end)
        if t.scheduled:
            tracing.record("prefill", t.parent, t.scheduled, t.first_token or now)
        if t.first_token:
            tracing.record(
                "decode",
                t.parent,
                t.first_token,
                now,
                {"request.output_tokens": num_output_tokens, "request.finish_reason": str(reason)},
            )
