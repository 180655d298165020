"""How a live request ends: it finishes (a stop rule, its length, a preemption, an error), is aborted, is planned in
a step the worker never finished, or is refused by its grammar's compile. Each end gives back what the request held
beside the scheduler's blocks: its structured-output entry, its hash chain, its history slot, its worker state."""

from __future__ import annotations

import logging

from scheduler_rs import StepPlan, StepResult
from services.engine.choice_groups import ChoiceGroups
from services.engine.engine_parts import EngineParts
from services.engine.finish_reason import FinishReason
from services.engine.outputs import RequestOutput

log = logging.getLogger("shinkai.engine")


class RequestEnds:
    def __init__(
        self,
        parts: EngineParts,
        choices: ChoiceGroups,
    ) -> None:
        self.parts = parts
        self.requests = parts.requests  # the engine's live requests (the same dict)
        self.structured = parts.structured
        self.hashes = parts.hashes  # the prefix cache's hash chains (None: caching off)
        self.choices = choices
        self.histories = parts.histories

    def finish(self, request_id: str, reason: FinishReason, stop_token_id: int | None) -> RequestOutput:
        """The request has left the scheduler: its final output (a prefix's: choice 0's, standing for the request)."""
        req = self.requests.pop(request_id)
        self.structured.drop(request_id)
        if self.hashes is not None:
            self.hashes.drop(request_id)
        if req.is_prefix:  # aborted before its fork: choice 0 stands for the request
            prefix_output = self.choices.finish(request_id, req, reason)
            assert prefix_output is not None
            return prefix_output
        req.output.finish_reason = reason
        req.output.stop_token_id = stop_token_id
        if req.history is not None:
            self.histories.give_back(req.history)
        if req.group is not None:
            self.choices.finish(request_id, req, reason)
        self.parts.worker.release(request_id)
        return req.output

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends the request (all its choices); returns its final output (choice 0's where n > 1)."""
        scheduler = self.parts.scheduler
        members = self.choices.members.get(request_id)
        if members is None:
            final = scheduler.abort(request_id)
            if final is None:
                return None
            return self.finish(request_id, FinishReason.of(final.finish_reason), None)
        outputs = []
        for member in list(members):
            final = scheduler.abort(member)
            if final is not None:
                outputs.append(self.finish(member, FinishReason.of(final.finish_reason), None))
        return min(outputs, key=lambda o: o.index) if outputs else None

    def fail(self, plan: StepPlan) -> None:
        """Closes a step the worker never finished: every planned request ends with "error" in the scheduler,
        and the blocks whose release waited for this step come back (without this update they never would).
        The prefix cache is dropped: a snapshot planned with the step may never have been saved."""
        n = plan.num_requests
        self.parts.scheduler.update(plan, StepResult([0] * n, [], errors=list(range(n))))
        if self.hashes is not None:
            self.parts.scheduler.clear_prefix_cache()

    def end_refused_grammars(self) -> list[RequestOutput]:
        """Constrained requests whose grammar compiled become schedulable (with their matcher); those whose
        compile failed or timed out end here with an error naming it. Returns their final outputs."""
        scheduler = self.parts.scheduler
        outputs = []
        for request_id, why in self.structured.admit(self.requests, scheduler):
            log.warning("request %s: %s", request_id, why)
            scheduler.abort(request_id)
            out = self.finish(request_id, FinishReason.ERROR, None)
            out.error = why
            outputs.append(out)
        return outputs

    def end_all(self) -> list[str]:
        """Ends every live request at once with no output of its own (a failed step, a lost data-parallel group):
        each leaves the scheduler and gives back what it held (as ``finish`` does). Returns the ids whose callers are
        owed a final output: every live request's, then every n > 1 request's."""
        ended = []
        for request_id in list(self.requests):
            self.parts.scheduler.abort(request_id)
            req = self.requests.pop(request_id)
            self.structured.drop(request_id)
            if self.hashes is not None:
                self.hashes.drop(request_id)
            if req.history is not None and not req.is_prefix:
                self.histories.give_back(req.history)
            self.parts.worker.release(request_id)
            ended.append(request_id)
        ended += self.choices.clear()
        return ended
