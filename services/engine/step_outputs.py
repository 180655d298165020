"""A step's update, folded into what the engine's callers get: each request's new tokens and their logprobs (and
prompt logprobs) in its ``RequestOutput``, an n > 1 prefix's fork into its choices, the matchers' advance, the
hash chains' growth, and the requests the update ended."""

from __future__ import annotations

from scheduler_rs import StepPlan
from services.engine.choice_groups import ChoiceGroups
from services.engine.engine_parts import EngineParts
from services.engine.finish_reason import FinishReason
from services.engine.outputs import RequestOutput
from services.engine.prompt_logprob_rows import add_prompt_logprobs
from services.engine.request_ends import RequestEnds
from services.worker.worker_output import WorkerOutput


class StepOutputs:
    def __init__(
        self,
        parts: EngineParts,
        choices: ChoiceGroups,
        ends: RequestEnds,
    ) -> None:
        self.parts = parts
        self.requests = parts.requests  # the engine's live requests (the same dict)
        self.structured = parts.structured
        self.hashes = parts.hashes  # the prefix cache's hash chains (None: caching off)
        self.choices = choices
        self.ends = ends
        self.last_plan: StepPlan | None = None  # the latest step's plan whose update was applied (metrics, traces)

    def apply(self, plan: StepPlan, executed: WorkerOutput, updates) -> list[RequestOutput]:
        """Folds the scheduler's updates of the step (``Scheduler.update``) and the worker's output into the live
        requests; returns the outputs that gained tokens or ended, each once."""
        self.last_plan = plan
        add_prompt_logprobs(plan, self.requests, executed.prompt_logprobs)
        changed: dict[str, RequestOutput] = {}
        for final in plan.outputs:  # preempted while scheduling
            reason = FinishReason.of(final.finish_reason)
            req = self.requests.get(final.request_id)
            if req is not None and req.is_prefix:
                for out in self.choices.end_prefix(final.request_id, reason):
                    changed[f"{out.request_id}\x00{out.index}"] = out
            else:
                changed[final.request_id] = self.ends.finish(final.request_id, reason, None)
        # Logprobs of each request's sampled rows, in plan order.
        sampled_logprobs: dict[str, list[int]] = {}
        row = 0
        request_ids = plan.request_ids  # one conversion: each access of the attribute builds a new list
        for i, n in enumerate(plan.num_sample_rows.tolist()):
            sampled_logprobs[request_ids[i]] = list(range(row, row + n))
            row += n
        # One device → host copy per array for the whole step (not one per row), queued with the step: on a
        # GPU a read of the device tensors here would wait for the step queued after this one.
        sampled = executed.sampled_on_host()
        logprobs = sampled.logprobs.tolist() if sampled is not None else []
        top: tuple[list, list] | None = None
        dead: list[str] = []  # constrained requests whose token their grammar refused
        for update in updates:
            req = self.requests.get(update.request_id)
            if req is None:
                continue
            if req.is_prefix:
                if update.finish_reason is None and update.token_ids:
                    self.choices.fork(update.request_id)
                elif update.finish_reason is not None:  # ended before its fork (preempted, an error)
                    for out in self.choices.end_prefix(update.request_id, FinishReason.of(update.finish_reason)):
                        changed[f"{out.request_id}\x00{out.index}"] = out
                continue
            rows = sampled_logprobs.get(update.request_id, [])
            out = req.output
            if not self.structured.advance(req, update.token_ids):
                dead.append(update.request_id)
            for k, token in enumerate(update.token_ids):
                out.token_ids.append(token)
                if sampled is not None and k < len(rows):
                    r = rows[k]
                    out.logprobs.append(float(logprobs[r]))
                    if out.top_logprobs is not None:
                        if top is None:
                            top = (sampled.top_token_ids.tolist(), sampled.top_logprobs.tolist())
                        n = req.params.logprobs or 0
                        out.top_logprobs.append(list(zip(top[0][r][:n], top[1][r][:n])))
            changed[update.request_id] = out
            out.num_cached_tokens = update.num_cached_tokens
            if self.hashes is not None and update.finish_reason is None:
                self.hashes.grow(update.request_id, out.prompt_token_ids + out.token_ids)
            if update.finish_reason is not None:
                changed[update.request_id] = self.ends.finish(
                    update.request_id, FinishReason.of(update.finish_reason), update.stop_token_id
                )
        for request_id in dead:
            if request_id in self.requests:  # not ended by the update itself
                self.parts.scheduler.abort(request_id)
                changed[request_id] = self.ends.finish(request_id, FinishReason.ERROR, None)
                changed[request_id].error = "the grammar rejected the sampled token"
        return list(changed.values())
