"""An engine's structured output: the constraints it accepts, the readiness gate its constrained requests wait
behind until their grammar has compiled, the per-step token bitmask, and each matcher's advance once the step's
tokens are read.

The engine calls it at fixed points of its step: `admit` before planning (compiled grammars make their requests
schedulable; failed ones are handed back to end with an error), `token_bitmask` for the planned step, and
`advance` for each request's new tokens. Everything here runs on the step thread except the compiles
(services/engine/structured/grammars.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future

import torch

from scheduler_rs import Scheduler, StepPlan
from services.engine.live_request import LiveRequest
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint
from services.engine.structured.grammar_gate import GrammarGate
from services.engine.structured.grammars import COMPILE_TIMEOUT_S, GrammarCompiler
from services.engine.structured.token_masks import advance, fill_token_bitmask

IDLE_WAIT_S = 0.01
"""With nothing to run but compiles, the step waits this long for one to finish rather than spinning."""


class StructuredOutput:
    def __init__(self, grammars: GrammarCompiler | None) -> None:
        """``grammars``: the compiler over the model's vocabulary; None refuses constrained requests."""
        self.grammars = grammars
        # Constrained requests waiting for their grammar's compile.
        self.gate = GrammarGate(grammars.timeout_s if grammars is not None else COMPILE_TIMEOUT_S)

    @property
    def timeout_s(self) -> float:
        """How long a compile may take before its request is refused."""
        return self.gate.timeout_s

    def check(self, params: SamplingParams, in_process_worker: bool) -> None:
        """ValueError for structured output this engine cannot serve, or a constraint that does not parse (it is
        parsed here and queued for compiling off the step thread)."""
        if params.constraint is None:
            return
        if self.grammars is None:
            raise ValueError(
                "structured output is not served by this engine: it has no grammar compiler (data-parallel ranks, "
                "and engines built without the model's tokenizer, have none yet)"
            )
        if not in_process_worker:
            raise ValueError(
                "structured output needs the in-process worker: the remote worker's protocol does not carry the "
                "token mask yet"
            )
        if params.forced_token_ids:
            raise ValueError("structured output cannot be combined with forced_token_ids")
        self.grammars.compile(params.constraint)

    def compiled(self, constraint: Constraint) -> Future | None:
        """The constraint's compile (shared by every request with its text); None on an engine without a compiler
        (which refused the constraint when the request was queued)."""
        return self.grammars.compile(constraint) if self.grammars is not None else None

    def hold(self, request_id: str, params: SamplingParams, ready: bool) -> bool:
        """Whether a new request is schedulable now: a constrained one waits behind the gate for its grammar (and
        its images, ``ready`` False)."""
        if params.constraint is None:
            return ready
        assert self.grammars is not None  # checked
        self.gate.hold(request_id, self.grammars.compile(params.constraint), images_pending=not ready)
        return False

    def images_arrived(self, request_id: str) -> bool:
        """A waiting request's images are in; True when the gate still holds it for its grammar (it becomes
        schedulable once that is ready too), False when it is schedulable now."""
        if request_id not in self.gate:
            return False
        self.gate.images_arrived(request_id)
        return True

    def matcher(self, constraint: Constraint):
        """A fresh matcher of an already compiled constraint (each choice of n > 1 at the fork)."""
        assert self.grammars is not None
        return self.grammars.matcher(self.grammars.compile(constraint).result())

    def admit(self, requests: Mapping[str, LiveRequest], scheduler: Scheduler) -> list[tuple[str, str]]:
        """Requests whose grammar compiled get their matcher and become schedulable; returns (request id, why) for
        those whose compile failed or timed out (the engine ends them with an error)."""
        if not self.gate:
            return []
        assert self.grammars is not None
        result = self.gate.poll()
        for request_id, compiled, images_ready in result.ready:
            req = requests[request_id]
            if not req.is_prefix:  # a prefix's choices get theirs at the fork
                req.matcher = self.grammars.matcher(compiled)
            if images_ready:
                scheduler.set_schedulable(request_id)
        for request_id, _ in result.refused:
            constraint = requests[request_id].params.constraint
            if constraint is not None:
                self.grammars.forget(constraint)  # retried by a later request, not served from the cache
        return result.refused

    def wait_idle(self, plan: StepPlan) -> None:
        """An empty step while compiles run: wait for one (briefly) instead of spinning on empty steps."""
        if plan.num_rows == 0 and self.gate:
            self.gate.wait(IDLE_WAIT_S)

    def has_matchers(self, requests: Mapping[str, LiveRequest]) -> bool:
        """Some live request walks a grammar matcher (async scheduling then samples each step only after the step in
        flight is read: ``AsyncSteps``, async_steps.py)."""
        return self.grammars is not None and any(r.matcher is not None for r in requests.values())

    def token_bitmask(self, plan: StepPlan, requests: Mapping[str, LiveRequest]) -> torch.Tensor | None:
        """The step's mask, one row per sampled row (None when no planned row is constrained)."""
        if self.grammars is None:
            return None
        return fill_token_bitmask(plan, requests, self.grammars)

    @staticmethod
    def advance(req: LiveRequest, token_ids: Sequence[int]) -> bool:
        """Feeds a request's new tokens to its matcher; False when its grammar refuses one (a dead end)."""
        return req.matcher is None or advance(req.matcher, token_ids)

    def drop(self, request_id: str) -> None:
        """The request ended: it no longer waits behind the gate."""
        self.gate.drop(request_id)
