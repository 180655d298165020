"""One engine replica: the scheduler, a worker, and the step loop of three calls."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence

from scheduler_rs import PreemptionMode, Scheduler, SchedulerConfig, Scheduling, StepPlan, StepResult
from services.engine.choice_groups import ChoiceGroups
from services.engine.config import EngineConfig
from services.engine.finish_reason import FinishReason
from services.engine.live_request import LiveRequest
from services.engine.outputs import RequestOutput
from services.engine.prefix.kv_events import KvEvents
from services.engine.prefix.request_hashes import RequestHashes, image_spans
from services.engine.prompt_logprob_rows import add_prompt_logprobs, prompt_rows
from services.engine.request_checks import check_priority, choice_id, validate_request
from services.engine.sampling_params import SamplingParams
from services.engine.stats import EngineStats
from services.engine.step_cost import StepCostMeter
from services.engine.step_worker import StepWorker
from services.engine.structured.grammars import GrammarCompiler
from services.engine.structured.structured_output import StructuredOutput
from services.worker.sampling.sampler import SamplingRow
from services.worker.worker import WorkerOutput

log = logging.getLogger("shinkai.engine")


class Engine:
    def __init__(
        self,
        worker: StepWorker,
        config: EngineConfig,
        *,
        vocab_size: int,
        eos_token_id: int,
        compress_ratios: Sequence[int],
        window_size: int,
        vote: Callable[[bool, str], bool] | None = None,
        grammars: GrammarCompiler | None = None,
        image_token_id: int | None = None,
        model: str = "",
    ) -> None:
        """``vote``: the data-parallel group's all-reduce of one bool ("all" or "any"), needed when
        ``config.data_parallel_size`` > 1 (services/engine/parallel/vote.py). ``grammars``: structured output's
        compiler over the model's vocabulary; None refuses constrained requests. ``image_token_id``: the model's
        image placeholder (None: no vision tower). ``model``: the name at the root of the prefix cache's block
        hashes (``block_hash.py``): the served name, so a gateway's router hashes prompts as this engine does."""
        if (vote is None) != (config.data_parallel_size == 1):
            raise ValueError(
                "an engine of a data-parallel group needs its group's vote, and only such an engine "
                f"takes one (data_parallel_size {config.data_parallel_size})"
            )
        if config.async_scheduling and not worker.in_process:
            raise ValueError(
                "async scheduling needs the in-process Worker: the remote worker's protocol does not "
                "carry the previous step's sampled tokens yet"
            )
        self.worker = worker
        self.config = config
        self.vote = vote  # the data-parallel group's vote; None for one process
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        mode = PreemptionMode.RECOMPUTE if config.preemption_mode == "recompute" else PreemptionMode.STOP
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=config.block_size,
                num_blocks=config.resolved_num_blocks(),
                num_state_slots=config.resolved_num_state_slots(),
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=config.max_model_len,
                window_size=window_size,
                compress_ratios=list(compress_ratios),
                preemption_mode=mode,
                scheduling=Scheduling.MIXED if config.scheduling == "mixed" else Scheduling.SEPARATE,
                vocab_size=vocab_size,
                nextn=config.num_speculative_tokens,
                spec_varlen=config.spec_varlen,
                num_ranks=config.data_parallel_size,
                enable_prefix_caching=config.enable_prefix_caching,
                num_state_snapshots=config.resolved_num_state_snapshots(),
            ),
            vote,
        )
        self.image_token_id = image_token_id
        self._num_worker_losses = worker.num_losses  # the worker's losses the prefix cache has seen
        # Prefix caching: each live request's block hash chain, given to the scheduler (None: caching off).
        self.hashes = RequestHashes(self.scheduler, config.block_size, model) if config.enable_prefix_caching else None
        # Varlen verification's step-cost curve: given, or measured from decode steps (None otherwise).
        self.step_cost: StepCostMeter | None = None
        self._last_read: float | None = None  # async: when the last decode step's result was read back
        if config.spec_step_cost_ms is not None:
            self.scheduler.set_step_cost(dict(config.spec_step_cost_ms))
        elif config.spec_varlen:
            self.step_cost = StepCostMeter(self.scheduler.config.graph_sizes)
            self.scheduler.set_step_cost(self.step_cost.curve(), measured=self.step_cost.measured())
        self.requests: dict[str, LiveRequest] = {}
        self._free_histories: list[int] = []  # token-count slots given back, reused first
        self._num_histories = 0
        self.last_plan: StepPlan | None = None  # the latest step's plan, for metrics and traces
        # Async scheduling: the step planned and executed but not yet updated, with its worker output.
        self._in_flight: tuple[StepPlan, WorkerOutput] | None = None
        self._seeds = random.SystemRandom()
        # Structured output: constraints checked, the grammar gate, the step's token bitmask, the matchers' advance.
        self.structured = StructuredOutput(grammars)
        # n > 1: the prefixes and choices of each request (choice_groups.py).
        self.choices = ChoiceGroups(
            self.scheduler,
            self.requests,
            config,
            eos_token_id,
            self.structured,
            self.hashes,
            self._choice,
            lambda member, prompt, params, seed, priority, tenant, group, index: self._add(
                member, prompt, params, seed, True, priority, tenant, group, index
            ),
            lambda request_id: self.worker.release(request_id),
        )
        self.groups = self.choices.members  # per user request id, its choices' engine ids (or its prefix's)

    # ---- requests ---------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError naming what is wrong; nothing is queued."""
        validate_request(prompt_token_ids, params, self.vocab_size, self.config)
        if (params.has_penalties or params.min_p or params.prompt_logprobs is not None) and not self.worker.in_process:
            raise ValueError(
                "presence_penalty, frequency_penalty, repetition_penalty, min_p and prompt_logprobs need the "
                "in-process worker: the remote worker's protocol does not carry them yet"
            )
        self.structured.check(params, self.worker.in_process)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        ready: bool = True,
        priority: int = 0,
        tenant: str = "",
    ) -> None:
        """``ready=False``: the request waits, holding nothing, until ``provide_images`` (the multimodal
        readiness gate); requests behind it in the queue are scheduled meanwhile. ``priority``: lower is
        served first, then earlier arrival; the last in that order is preempted first. ``tenant``: who the request
        is served for (an API key's owner or a client's address); the queue goes first by the tenant served least
        (docs/architecture.md, "The waiting queue's order"); "" is the one tenant of requests given none.

        ``params.n`` > 1 (choices, each output's ``index``): the prompt but its last token is prefilled once, as
        a *prefix* request whose one output is forced to the prompt's last token; the scheduler then forks it
        into n choices that share its full blocks (each gets a copy of the partial block and state slot),
        and the prefix ends. Choice i computes the prompt's last token itself and draws with
        ``params.choice_seed(seed, i)``. A prompt of one token has no prefix: its choices are n requests."""
        check_priority(priority)
        self.validate(prompt_token_ids, params)
        if params.n > 1 and not ready:
            raise ValueError("n > 1 with images is not served yet: a recomputed choice would need the prefix's images")
        if request_id in self.requests or request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        if params.n == 1:
            self._add(request_id, prompt, params, seed, ready, priority, tenant)
            return
        if len(prompt) == 1:
            self.groups[request_id] = [choice_id(request_id, i) for i in range(params.n)]
            for i, member in enumerate(self.groups[request_id]):
                self._add(member, prompt, params, params.choice_seed(seed, i), ready, priority, tenant, request_id, i)
            return
        prefix = self.choices.add_prefix(request_id, prompt, params, seed, ready, priority, tenant)
        self._hash(prefix, prompt[:-1], params, ready)

    def _add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        ready: bool,
        priority: int,
        tenant: str,
        group: str | None = None,
        index: int = 0,
    ) -> None:
        self.scheduler.add_request(
            request_id,
            prompt,
            max_tokens=params.resolved_max_tokens(len(prompt), self.config.max_model_len),
            eos_token_id=self.eos_token_id,
            ignore_eos=params.ignore_eos,
            stop_token_ids=list(params.stop_token_ids),
            schedulable=self.structured.hold(request_id, params, ready),
            constrained=params.constraint is not None,
            priority=priority,
            tenant=tenant,
        )
        self._hash(request_id, prompt, params, ready)
        self.requests[request_id] = self._choice(group or request_id, prompt, params, seed, group, index)

    @property
    def prefix_cache_enabled(self) -> bool:
        """Whether this engine caches prefixes (its block size: ``config.block_size``)."""
        return self.hashes is not None

    def take_kv_events(self) -> KvEvents:
        """The blocks that entered and left the prefix cache since the last call (block_hash.py's hashes)."""
        stored, removed, cleared = self.scheduler.take_kv_events()
        return KvEvents(stored, removed, cleared)

    def _hash(self, request_id: str, prompt: list[int], params: SamplingParams, ready: bool, rows=None) -> None:
        """Gives the scheduler the request's block hashes: now, or (images pending) when its images arrive.
        A request that asks for prompt logprobs computes every position, so it never resumes from the cache."""
        if self.hashes is None or not ready:
            return
        spans = (
            image_spans(prompt, self.image_token_id, rows)
            if rows is not None and self.image_token_id is not None
            else ()
        )
        self.hashes.admit(request_id, prompt, params.cache_salt, spans, lookup=params.prompt_logprobs is None)

    def _choice(
        self, user_id: str, prompt: list[int], params: SamplingParams, seed: int, group: str | None, index: int
    ) -> LiveRequest:
        banned = tuple(sorted(set(params.banned_token_ids)))
        stops = set(params.stop_token_ids) | ({self.eos_token_id} if not params.ignore_eos else set())
        history = None
        if params.has_penalties:
            history = self._free_histories.pop() if self._free_histories else self._num_histories
            self._num_histories = max(self._num_histories, history + 1)
        return LiveRequest(
            RequestOutput(user_id, prompt, top_logprobs=[] if params.logprobs else None, index=index),
            params,
            seed,
            banned,
            tuple(sorted(set(banned) | {self.eos_token_id})),
            tuple(sorted(set(banned) | stops)),
            history,
            tuple(prompt) if history is not None else None,
            group,
        )

    def provide_images(self, request_id: str, rows) -> None:
        """A waiting request's image embeddings [P, D] (its P placeholders, in prompt order) have arrived:
        the worker takes them and the request becomes schedulable."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"no live request {request_id!r}")
        set_images = getattr(self.worker, "set_images", None)
        if set_images is None:  # a worker that takes no images (in-process and worker.v1 workers both do)
            raise ValueError(f"{type(self.worker).__name__} takes no image embeddings")
        set_images(request_id, req.output.prompt_token_ids, rows)
        self._hash(request_id, req.output.prompt_token_ids, req.params, True, rows)
        if not self.structured.images_arrived(request_id):  # else schedulable once its grammar is ready too
            self.scheduler.set_schedulable(request_id)

    def is_live(self, request_id: str) -> bool:
        """The request (or, n > 1, some choice of it) is queued or running."""
        return request_id in self.requests or request_id in self.groups

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends the request (all its choices); returns its final output (choice 0's where n > 1)."""
        members = self.groups.get(request_id)
        if members is None:
            final = self.scheduler.abort(request_id)
            if final is None:
                return None
            return self._finish(request_id, FinishReason.of(final.finish_reason), None)
        outputs = []
        for member in list(members):
            final = self.scheduler.abort(member)
            if final is not None:
                outputs.append(self._finish(member, FinishReason.of(final.finish_reason), None))
        return min(outputs, key=lambda o: o.index) if outputs else None

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    def stats(self) -> EngineStats:
        s = self.scheduler.stats()
        return EngineStats(
            free_blocks=s.num_free_blocks,
            total_blocks=s.num_total_blocks,
            free_state_slots=s.num_free_state_slots,
            total_state_slots=s.num_total_state_slots,
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            decode_step=s.decode_step,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
        )

    # ---- the step loop ----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step: schedule, execute, update. Returns the requests that gained tokens or ended."""
        self._forget_lost_worker_state()
        if self.config.async_scheduling:
            return self._step_async()
        refused = self._admit_grammars()
        plan = self.scheduler.schedule()
        self.structured.wait_idle(plan)
        start = time.perf_counter()
        extra = prompt_rows(plan, self.requests)
        mask = self.structured.token_bitmask(plan, self.requests)
        if mask is not None:
            extra["token_bitmask"] = mask
        try:
            executed = self.worker.execute(plan, self._sampling_rows(plan), **extra)
            result = executed.result  # read back: the step is over
        except BaseException:
            self._fail(plan)
            raise
        if self._times_step(plan):
            self._record_step_cost(plan, 1e3 * (time.perf_counter() - start))
        updates = self.scheduler.update(plan, result)
        self.last_plan = plan
        return refused + self._apply(plan, executed, updates)

    def _admit_grammars(self) -> list[RequestOutput]:
        """Constrained requests whose grammar compiled become schedulable (with their matcher); those whose
        compile failed or timed out end with an error naming it."""
        outputs = []
        for request_id, why in self.structured.admit(self.requests, self.scheduler):
            log.warning("request %s: %s", request_id, why)
            self.scheduler.abort(request_id)
            out = self._finish(request_id, FinishReason.ERROR, None)
            out.error = why
            outputs.append(out)
        return outputs

    def _step_async(self) -> list[RequestOutput]:
        """Schedule N+1, execute N+1, update N: step N stays in flight while N+1 is planned, as on a GPU
        where the CPU plans the next step while the current one runs. The scheduler counts N as fully
        accepted and defers frees until the last step naming a block is updated; the worker replaces N+1's
        stand-in inputs by N's sampled tokens and, with drafts, by N's new drafts, and moves N+1's rows down
        by the rows N rejected (the seqlen fix-up, ``StepBatch.fix_positions``). The worker call is synchronous here,
        so executing N+1 before updating N is the GPU's order: N+1 is queued behind N, then N is read back.

        Decode and mixed steps stay in flight (a mixed step's next prompt chunk is prompt tokens, known without
        it; a prompt whose last chunk is in flight decodes next from the token that chunk samples). A prefill
        step (or one with no rows) is updated right after it runs (drained): with no decode row to keep busy,
        its prompts' first tokens come out at once. So is a step that samples an n > 1 group's prefix: its fork needs
        no step of it in flight."""
        previous = self._in_flight
        if previous is not None and not self.scheduler.has_unfinished() and self.vote is None:
            self._in_flight = None  # nothing to plan: the step in flight is the last (its rows may be dead)
            return self._update(*previous)
        drained = self._admit_grammars()
        masked = self.structured.has_matchers(self.requests)
        if previous is not None and masked and self.config.num_speculative_tokens:
            # Structured output with drafts: the mask's rows follow the plan's drafts, which are stand-ins while
            # the step in flight is not read, so that step is read back (and updated) before the next is planned.
            self._in_flight = None
            drained = _merge(drained, self._update(*previous))
            previous = None
        # A rank of a data-parallel group plans even then: its empty plan is a placeholder step, so the rank
        # joins the step's votes and exchanges like every other rank, and the step in flight is updated after it.
        plan = self.scheduler.schedule()
        if previous is None:
            self.structured.wait_idle(plan)
        if masked and not self.config.num_speculative_tokens:
            outputs, executed = self._launch_masked(plan, previous)
            outputs = _merge(drained, outputs)
        else:
            extra = prompt_rows(plan, self.requests)
            mask = self.structured.token_bitmask(plan, self.requests)
            if mask is not None:
                extra["token_bitmask"] = mask
            try:
                executed = self.worker.execute(
                    plan,
                    self._sampling_rows(plan, previous),
                    previous[1] if previous is not None else None,
                    **extra,
                )
            except BaseException:
                self._abandon(plan, previous)
                raise
            self._in_flight = None
            outputs = _merge(drained, self._update(*previous) if previous is not None else [])
        if plan.kind == "prefill" or plan.num_rows == 0 or self.choices.samples_a_prefix(plan):
            outputs = _merge(outputs, self._update(plan, executed))
        else:
            self._in_flight = (plan, executed)
        return outputs

    def _abandon(self, plan: StepPlan, previous: tuple[StepPlan, WorkerOutput] | None) -> None:
        """A step that never launched: the step in flight is updated (it ran) and this one is failed."""
        if previous is not None:
            self._in_flight = None
            self._update(*previous)
        self._fail(plan)

    def _launch_masked(
        self, plan: StepPlan, previous: tuple[StepPlan, WorkerOutput] | None
    ) -> tuple[list[RequestOutput], WorkerOutput]:
        """Async scheduling with structured output: the mask is a sampler input only. The step's forward is queued
        first (its inputs wait for the step in flight on the device, as any async step's); then the step in flight
        is read and updated, its tokens advancing the matchers, while the device runs the forward; then this step's
        mask is filled from them and its sampling queued behind the forward (the mask's upload is stream-ordered
        before the sampler). Returns the step in flight's outputs and this step's worker output."""
        try:
            launched = self.worker.launch(
                plan,
                self._sampling_rows(plan, previous),
                previous[1] if previous is not None else None,
                **prompt_rows(plan, self.requests),
            )
        except BaseException:
            self._abandon(plan, previous)
            raise
        self._in_flight = None
        try:
            outputs = self._update(*previous) if previous is not None else []
            executed = self.worker.sample(launched, self.structured.token_bitmask(plan, self.requests))
        except BaseException:
            self._fail(plan)  # launched but never sampled: its blocks come back
            raise
        return outputs, executed

    def _update(self, plan: StepPlan, executed: WorkerOutput) -> list[RequestOutput]:
        result = executed.result  # read back: the step is over
        if self.step_cost is not None:
            # Async: a decode step's cost is the time between its read-back and the previous decode step's (it was
            # queued behind that one, so the interval is its own device time, or the host's cadence where that is
            # longer: either way what a step of its size costs). A prefill or empty step in between breaks the pair.
            now, timed = time.perf_counter(), self._times_step(plan)
            if timed and self._last_read is not None:
                self._record_step_cost(plan, 1e3 * (now - self._last_read))
            self._last_read = now if timed else None
        updates = self.scheduler.update(plan, result)
        self.last_plan = plan
        return self._apply(plan, executed, updates)

    def _times_step(self, plan: StepPlan) -> bool:
        """Whether varlen's meter takes this step's time: a decode step with rows, under a graph size."""
        return self.step_cost is not None and plan.graph_size is not None and not plan.is_prefill and plan.num_rows > 0

    def _record_step_cost(self, plan: StepPlan, ms: float) -> None:
        if self.step_cost.record(plan.graph_size, ms, plan.num_requests):  # the next batch is most likely this one's
            self.scheduler.set_step_cost(
                self.step_cost.curve(plan.num_requests), measured=self.step_cost.measured(plan.num_requests)
            )

    def _fail(self, plan: StepPlan) -> None:
        """Closes a step the worker never finished: every planned request ends with "error" in the scheduler,
        and the blocks whose release waited for this step come back (without this update they never would).
        The prefix cache is dropped: a snapshot planned with the step may never have been saved."""
        n = plan.num_requests
        self.scheduler.update(plan, StepResult([0] * n, [], errors=list(range(n))))
        if self.hashes is not None:
            self.scheduler.clear_prefix_cache()

    def _forget_lost_worker_state(self) -> None:
        """Drops the prefix cache once the worker has lost its pools (a worker process restarted), so no request
        resumes from memory that is gone."""
        num_losses = self.worker.num_losses
        if num_losses != self._num_worker_losses and self.hashes is not None:
            self.scheduler.clear_prefix_cache()
        self._num_worker_losses = num_losses

    def _sampling_rows(
        self, plan: StepPlan, in_flight: tuple[StepPlan, WorkerOutput] | None = None
    ) -> list[SamplingRow]:
        rows = []
        seqlens_k = plan.seqlens_k.tolist()
        # Tokens of the step in flight are not in the outputs yet; counted as accepted, as the scheduler does.
        ahead: dict[str, int] = {}
        if in_flight is not None:
            ahead = dict(zip(in_flight[0].request_ids, in_flight[0].num_sample_rows.tolist()))
        request_ids = plan.request_ids  # one conversion: each access of the attribute builds a new list
        for i, n in enumerate(plan.num_sample_rows.tolist()):
            if n == 0:
                continue
            req = self.requests[request_ids[i]]
            num_out = len(req.output.token_ids) + ahead.get(request_ids[i], 0)
            rows += req.sampling_rows(n, seqlens_k[i], num_out, self.config)
        return rows

    def _apply(self, plan: StepPlan, executed: WorkerOutput, updates) -> list[RequestOutput]:
        add_prompt_logprobs(plan, self.requests, executed.prompt_logprobs)
        changed: dict[str, RequestOutput] = {}
        for final in plan.outputs:  # preempted while scheduling
            reason = FinishReason.of(final.finish_reason)
            req = self.requests.get(final.request_id)
            if req is not None and req.is_prefix:
                for out in self.choices.end_prefix(final.request_id, reason):
                    changed[f"{out.request_id}\x00{out.index}"] = out
            else:
                changed[final.request_id] = self._finish(final.request_id, reason, None)
        # Logprobs of each request's sampled rows, in plan order.
        sampled_logprobs: dict[str, list[int]] = {}
        row = 0
        request_ids = plan.request_ids  # one conversion (see _sampling_rows)
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
                changed[update.request_id] = self._finish(
                    update.request_id, FinishReason.of(update.finish_reason), update.stop_token_id
                )
        for request_id in dead:
            if request_id in self.requests:  # not ended by the update itself
                self.scheduler.abort(request_id)
                changed[request_id] = self._finish(request_id, FinishReason.ERROR, None)
                changed[request_id].error = "the grammar rejected the sampled token"
        return list(changed.values())

    def _finish(self, request_id: str, reason: FinishReason, stop_token_id: int | None) -> RequestOutput:
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
            self._free_histories.append(req.history)
        if req.group is not None:
            self.choices.finish(request_id, req, reason)
        self.worker.release(request_id)
        return req.output


def _merge(first: list[RequestOutput], second: list[RequestOutput]) -> list[RequestOutput]:
    """Outputs of two updates in one call, each request once (its output object is shared)."""
    seen = {id(o) for o in first}
    return first + [o for o in second if id(o) not in seen]
