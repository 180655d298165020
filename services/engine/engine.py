"""One engine replica: the scheduler, a worker, and the step loop of three calls.

The engine composes its parts, each its own module: ``RequestAdmission`` (requests in), ``StepInputs`` (what the
worker takes with a plan), ``StepOutputs`` (a step's update folded into the outputs), ``RequestEnds`` (finishes,
aborts, failed steps), ``AsyncSteps`` (the step loop under async scheduling) and ``StepClock`` (varlen's measured
step costs). They share the scheduler, the worker and the configuration through ``EngineParts``, so setting one of
them on the engine reaches every part, and the per-engine state (live requests, structured output, hash chains,
history slots) with them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from scheduler_rs import PreemptionMode, Scheduler, SchedulerConfig, Scheduling, StepPlan
from services.engine.async_steps import AsyncSteps
from services.engine.config import EngineConfig
from services.engine.engine_parts import EngineParts
from services.engine.history_slots import HistorySlots
from services.engine.outputs import RequestOutput
from services.engine.prefix.kv_events import KvEvents
from services.engine.prefix.request_hashes import RequestHashes
from services.engine.request_admission import RequestAdmission
from services.engine.request_ends import RequestEnds
from services.engine.sampling_params import SamplingParams
from services.engine.stats import EngineStats
from services.engine.step_clock import StepClock
from services.engine.step_cost import StepCostMeter
from services.engine.step_inputs import StepInputs
from services.engine.step_outputs import StepOutputs
from services.engine.step_worker import StepWorker
from services.engine.structured.grammars import GrammarCompiler
from services.engine.structured.structured_output import StructuredOutput


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
        self.vote = vote  # the data-parallel group's vote; None for one process
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.image_token_id = image_token_id
        scheduler = _scheduler(config, window_size, compress_ratios, vocab_size, vote)
        self.parts = EngineParts(
            scheduler,
            worker,
            config,
            requests={},
            structured=StructuredOutput(grammars),
            hashes=RequestHashes(scheduler, config.block_size, model) if config.enable_prefix_caching else None,
            histories=HistorySlots(),
        )
        self.requests = self.parts.requests  # the live requests (engine_parts.py says what each of these holds)
        self.structured = self.parts.structured
        self.hashes = self.parts.hashes
        self._num_worker_losses = worker.num_losses  # the worker's losses the prefix cache has seen
        # Varlen verification's step-cost curve: given, or measured from decode steps.
        self.clock = StepClock(self.parts)
        self.admission = RequestAdmission(
            self.parts, vocab_size=vocab_size, eos_token_id=eos_token_id, image_token_id=image_token_id
        )
        self.choices = self.admission.choices  # n > 1: the prefixes and choices of each request
        self.groups = self.choices.members  # per user request id, its choices' engine ids (or its prefix's)
        self.ends = RequestEnds(self.parts, self.choices)
        self.inputs = StepInputs(self.parts)
        self.outputs = StepOutputs(self.parts, self.choices, self.ends)
        self.async_steps = AsyncSteps(self.parts, vote, self.choices, self.inputs, self.outputs, self.ends, self.clock)

    # ---- the shared parts -------------------------------------------------------------------

    @property
    def scheduler(self) -> Scheduler:
        return self.parts.scheduler

    @scheduler.setter
    def scheduler(self, scheduler: Scheduler) -> None:
        self.parts.scheduler = scheduler

    @property
    def worker(self) -> StepWorker:
        return self.parts.worker

    @worker.setter
    def worker(self, worker: StepWorker) -> None:
        self.parts.worker = worker

    @property
    def config(self) -> EngineConfig:
        return self.parts.config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self.parts.config = config

    @property
    def step_cost(self) -> StepCostMeter | None:
        """Varlen verification's measured step-cost curve (None: given, or varlen off)."""
        return self.clock.meter

    @property
    def last_plan(self) -> StepPlan | None:
        """The latest step's plan, for metrics and traces (None before the first step)."""
        return self.outputs.last_plan

    # ---- requests ---------------------------------------------------------------------------

    def validate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raises ValueError naming what is wrong; nothing is queued."""
        self.admission.validate(prompt_token_ids, params)

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
        self.admission.add(request_id, prompt_token_ids, params, ready, priority, tenant)

    def provide_images(self, request_id: str, rows) -> None:
        """A waiting request's image embeddings [P, D] (its P placeholders, in prompt order) have arrived:
        the worker takes them and the request becomes schedulable."""
        self.admission.provide_images(request_id, rows)

    def is_live(self, request_id: str) -> bool:
        """The request (or, n > 1, some choice of it) is queued or running."""
        return self.admission.is_live(request_id)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Ends the request (all its choices); returns its final output (choice 0's where n > 1)."""
        return self.ends.abort(request_id)

    def end_all(self) -> list[str]:
        """Ends every live request with no output of its own (a failed step, a lost data-parallel group), giving
        back its blocks, state slot and worker state; returns the request ids owed a final output."""
        return self.ends.end_all()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.async_steps.in_flight is not None

    @property
    def prefix_cache_enabled(self) -> bool:
        """Whether this engine caches prefixes (its block size: ``config.block_size``)."""
        return self.hashes is not None

    def take_kv_events(self) -> KvEvents:
        """The blocks that entered and left the prefix cache since the last call (block_hash.py's hashes)."""
        stored, removed, cleared = self.scheduler.take_kv_events()
        return KvEvents(stored, removed, cleared)

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
            return self.async_steps.step()
        refused = self.ends.end_refused_grammars()
        plan = self.scheduler.schedule()
        self.structured.wait_idle(plan)
        start = time.perf_counter()
        extra = self.inputs.extras(plan)
        try:
            executed = self.worker.execute(plan, self.inputs.rows(plan), **extra)
            result = executed.result  # read back: the step is over
        except BaseException:
            self.ends.fail(plan)
            raise
        self.clock.took(plan, start)
        updates = self.scheduler.update(plan, result)
        return refused + self.outputs.apply(plan, executed, updates)

    def _forget_lost_worker_state(self) -> None:
        """Drops the prefix cache once the worker has lost its pools (a worker process restarted), so no request
        resumes from memory that is gone."""
        num_losses = self.worker.num_losses
        if num_losses != self._num_worker_losses and self.hashes is not None:
            self.scheduler.clear_prefix_cache()
        self._num_worker_losses = num_losses


def _scheduler(
    config: EngineConfig,
    window_size: int,
    compress_ratios: Sequence[int],
    vocab_size: int,
    vote: Callable[[bool, str], bool] | None,
) -> Scheduler:
    """The replica's scheduler over the configuration's pools and limits and the model's attention shape."""
    mode = PreemptionMode.RECOMPUTE if config.preemption_mode == "recompute" else PreemptionMode.STOP
    return Scheduler(
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
