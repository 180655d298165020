"""Async scheduling's step: schedule N+1, execute N+1, update N. Step N stays in flight while N+1 is planned, as on
a GPU where the CPU plans the next step while the current one runs. The scheduler counts N as fully accepted and
defers frees until the last step naming a block is updated; the worker replaces N+1's stand-in inputs by N's sampled
tokens and, with drafts, by N's new drafts, and moves N+1's rows down by the rows N rejected (the seqlen fix-up,
``StepBatch.fix_positions``). The worker call is synchronous here, so executing N+1 before updating N is the GPU's
order: N+1 is queued behind N, then N is read back.

Decode and mixed steps stay in flight (a mixed step's next prompt chunk is prompt tokens, known without it; a prompt
whose last chunk is in flight decodes next from the token that chunk samples). A prefill step (or one with no rows)
is updated right after it runs (drained): with no decode row to keep busy, its prompts' first tokens come out at
once. So is a step that samples an n > 1 group's prefix: its fork needs no step of it in flight."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_rs import StepPlan
from services.engine.choice_groups import ChoiceGroups
from services.engine.engine_parts import EngineParts
from services.engine.outputs import RequestOutput
from services.engine.request_ends import RequestEnds
from services.engine.step_clock import StepClock
from services.engine.step_inputs import StepInputs
from services.engine.step_outputs import StepOutputs
from services.worker.worker_output import WorkerOutput


class AsyncSteps:
    def __init__(
        self,
        parts: EngineParts,
        vote: Callable[[bool, str], bool] | None,
        choices: ChoiceGroups,
        inputs: StepInputs,
        outputs: StepOutputs,
        ends: RequestEnds,
        clock: StepClock,
    ) -> None:
        self.parts = parts
        self.vote = vote  # the data-parallel group's vote; None for one process
        self.requests = parts.requests  # the engine's live requests (the same dict)
        self.structured = parts.structured
        self.choices = choices
        self.inputs = inputs
        self.outputs = outputs
        self.ends = ends
        self.clock = clock
        # The step planned and executed but not yet updated, with its worker output.
        self.in_flight: tuple[StepPlan, WorkerOutput] | None = None

    def step(self) -> list[RequestOutput]:
        """One ``Engine.step`` under async scheduling (the module docstring says what runs when)."""
        scheduler, config = self.parts.scheduler, self.parts.config
        previous = self.in_flight
        if previous is not None and not scheduler.has_unfinished() and self.vote is None:
            self.in_flight = None  # nothing to plan: the step in flight is the last (its rows may be dead)
            return self.update(*previous)
        drained = self.ends.end_refused_grammars()
        masked = self.structured.has_matchers(self.requests)
        if previous is not None and masked and config.num_speculative_tokens:
            # Structured output with drafts: the mask's rows follow the plan's drafts, which are stand-ins while
            # the step in flight is not read, so that step is read back (and updated) before the next is planned.
            self.in_flight = None
            drained = _merge(drained, self.update(*previous))
            previous = None
        # A rank of a data-parallel group plans even then: its empty plan is a placeholder step, so the rank
        # joins the step's votes and exchanges like every other rank, and the step in flight is updated after it.
        plan = scheduler.schedule()
        if previous is None:
            self.structured.wait_idle(plan)
        if masked and not config.num_speculative_tokens:
            outputs, executed = self._launch_masked(plan, previous)
            outputs = _merge(drained, outputs)
        else:
            extra = self.inputs.extras(plan)
            try:
                executed = self.parts.worker.execute(
                    plan,
                    self.inputs.rows(plan, previous),
                    previous[1] if previous is not None else None,
                    **extra,
                )
            except BaseException:
                self._abandon(plan, previous)
                raise
            self.in_flight = None
            outputs = _merge(drained, self.update(*previous) if previous is not None else [])
        if plan.kind == "prefill" or plan.num_rows == 0 or self.choices.samples_a_prefix(plan):
            outputs = _merge(outputs, self.update(plan, executed))
        else:
            self.in_flight = (plan, executed)
        return outputs

    def update(self, plan: StepPlan, executed: WorkerOutput) -> list[RequestOutput]:
        """Reads an executed step back and applies it: the scheduler's update, then the outputs."""
        result = executed.result  # read back: the step is over
        self.clock.read_back(plan)
        updates = self.parts.scheduler.update(plan, result)
        return self.outputs.apply(plan, executed, updates)

    def _abandon(self, plan: StepPlan, previous: tuple[StepPlan, WorkerOutput] | None) -> None:
        """A step that never launched: the step in flight is updated (it ran) and this one is failed."""
        if previous is not None:
            self.in_flight = None
            self.update(*previous)
        self.ends.fail(plan)

    def _launch_masked(
        self, plan: StepPlan, previous: tuple[StepPlan, WorkerOutput] | None
    ) -> tuple[list[RequestOutput], WorkerOutput]:
        """Async scheduling with structured output: the mask is a sampler input only. The step's forward is queued
        first (its inputs wait for the step in flight on the device, as any async step's); then the step in flight
        is read and updated, its tokens advancing the matchers, while the device runs the forward; then this step's
        mask is filled from them and its sampling queued behind the forward (the mask's upload is stream-ordered
        before the sampler). Returns the step in flight's outputs and this step's worker output."""
        worker = self.parts.worker
        try:
            launched = worker.launch(
                plan,
                self.inputs.rows(plan, previous),
                previous[1] if previous is not None else None,
                **self.inputs.prompt_rows(plan),
            )
        except BaseException:
            self._abandon(plan, previous)
            raise
        self.in_flight = None
        try:
            outputs = self.update(*previous) if previous is not None else []
            executed = worker.sample(launched, self.structured.token_bitmask(plan, self.requests))
        except BaseException:
            self.ends.fail(plan)  # launched but never sampled: its blocks come back
            raise
        return outputs, executed


def _merge(first: list[RequestOutput], second: list[RequestOutput]) -> list[RequestOutput]:
    """Outputs of two updates in one call, each request once (its output object is shared)."""
    seen = {id(o) for o in first}
    return first + [o for o in second if id(o) not in seen]
