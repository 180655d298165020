"""Shinkai's scheduler and block manager (Rust). DeepInfer's semantics; see docs/architecture.md, "The step loop".

The engine loop is ``plan = scheduler.schedule()`` → run it → ``scheduler.update(plan, result)``.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import final

@final
class FinishReason:
    """Why a request ended. ``.value`` is the string shared by the protos and the HTTP API."""

    STOP: FinishReason
    LENGTH: FinishReason
    ABORT: FinishReason
    PREEMPTED: FinishReason
    ERROR: FinishReason
    @property
    def value(self) -> str: ...
    def __int__(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class EngineType:
    """NORMAL votes prefill or decode per step; PROMPT only prefills; DECODE only decodes."""

    NORMAL: EngineType
    PROMPT: EngineType
    DECODE: EngineType
    def __int__(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class PreemptionMode:
    """STOP ends the victim with ``preempted``; RECOMPUTE prefills it again later."""

    STOP: PreemptionMode
    RECOMPUTE: PreemptionMode
    def __int__(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Scheduling:
    """How a NORMAL engine fills a step: SEPARATE (DeepInfer's prompt-or-decode steps, chosen by the vote) or
    MIXED (every decode row, then prompt chunks in the budget left). PROMPT and DECODE engines are separate."""

    SEPARATE: Scheduling
    MIXED: Scheduling
    def __int__(self) -> int: ...
    def __eq__(self, value: object, /) -> bool: ...
    def __ne__(self, value: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class Int32Array:
    """Read-only int32 vector with the buffer protocol: ``numpy.frombuffer(a, numpy.int32)``."""

    def __len__(self) -> int: ...
    def __getitem__(self, key: int, /) -> int: ...
    def tolist(self) -> list[int]: ...

@final
class SchedulerConfig:
    """Scheduler settings. Pool sizes include the null id 0. The six sizes are required: their
    user-facing defaults are ``EngineConfig``'s (services/engine/config.py), which passes every one.
    The vote intervals default to 1 for one rank and to DeepInfer's 70 (ALL) / 100 (ANY) for several."""

    def __new__(
        cls,
        *,
        block_size: int,
        num_blocks: int,
        num_state_slots: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_ranks: int = 1,
        engine_type: EngineType = ...,
        nextn: int = 0,
        window_size: int = 128,
        compress_ratios: Sequence[int] = ...,
        preemption_mode: PreemptionMode = ...,
        scheduling: Scheduling = ...,
        prefill_attempt_interval: int | None = None,
        prefill_any_attempt_interval: int | None = None,
        prefill_max_cache_usage: float = 0.9,
        cuda_graph_interval: int = 8,
        vocab_size: int | None = None,
        draft_pad_token_id: int = 0,
        spec_varlen: bool = False,
        enable_prefix_caching: bool = False,
        num_state_snapshots: int = 0,
    ) -> SchedulerConfig: ...
    @property
    def engine_type(self) -> EngineType: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_state_slots(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def nextn(self) -> int: ...
    @property
    def window_size(self) -> int: ...
    @property
    def compress_ratios(self) -> list[int]: ...
    @property
    def preemption_mode(self) -> PreemptionMode: ...
    @property
    def scheduling(self) -> Scheduling: ...
    @property
    def prefill_attempt_interval(self) -> int: ...
    @property
    def prefill_any_attempt_interval(self) -> int: ...
    @property
    def prefill_max_cache_usage(self) -> float: ...
    @property
    def cuda_graph_interval(self) -> int: ...
    @property
    def vocab_size(self) -> int | None: ...
    @property
    def spec_varlen(self) -> bool:
        """Variable-length verification: per request, the prefix of its drafts ``MtpVarlen`` picks from the
        drafts' confidences and the step-cost curve (``Scheduler.set_step_cost``); off: ``nextn`` drafts."""
    @property
    def draft_pad_token_id(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def num_state_snapshots(self) -> int:
        """State snapshots (prefix caching): worker state slots ``num_state_slots …`` after the request slots."""
    @property
    def ring_size(self) -> int:
        """Window ring positions: window + max(6, nextn + 1)."""
    @property
    def graph_sizes(self) -> list[int]:
        """CUDA graph sizes: powers of two up to the interval, then its multiples."""

@final
class BlockManager:
    """Free list with reference counts: allocate from the head, free to the tail at count 0."""

    def __new__(cls, num_ids: int) -> BlockManager: ...
    @property
    def num_total(self) -> int: ...
    @property
    def num_free(self) -> int: ...
    def allocate(self) -> int | None: ...
    def free(self, block_id: int) -> None: ...
    def incref(self, block_id: int) -> None: ...
    def ref_count(self, block_id: int) -> int: ...
    def free_ids(self) -> list[int]: ...

@final
class StepPlan:
    """One step for the worker. Per-request arrays in plan order; per-row arrays with each request's
    rows contiguous from ``query_start[i]``."""

    @property
    def step_id(self) -> int: ...
    @property
    def kind(self) -> str:
        """ "prefill", "decode" or "mixed"."""
    @property
    def num_decode_requests(self) -> int:
        """Requests 0 … num_decode_requests − 1 are decode rows; the rest are prompt chunks."""
    @property
    def is_prefill(self) -> bool: ...
    @property
    def is_placeholder(self) -> bool:
        """No rows here; the worker runs one fake row that routes nowhere (block 0, slot 0)."""
    @property
    def num_requests(self) -> int: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def request_ids(self) -> list[str]: ...
    @property
    def seqlens_q(self) -> Int32Array: ...
    @property
    def seqlens_k(self) -> Int32Array: ...
    @property
    def query_start(self) -> Int32Array: ...
    @property
    def state_slots(self) -> Int32Array: ...
    @property
    def block_tables(self) -> Int32Array:
        """``num_requests × block_table_width``, row-major, padded with block 0."""
    @property
    def block_table_width(self) -> int: ...
    @property
    def inputs_pending(self) -> Int32Array:
        """1 where inputs depend on a step still in flight (async scheduling)."""
    @property
    def input_ids(self) -> Int32Array: ...
    @property
    def positions(self) -> Int32Array: ...
    @property
    def ring_slots(self) -> Int32Array:
        """``position mod ring_size`` per row."""
    @property
    def row_requests(self) -> Int32Array: ...
    @property
    def sample_rows(self) -> Int32Array: ...
    @property
    def num_sample_rows(self) -> Int32Array: ...
    @property
    def propose_drafts(self) -> Int32Array:
        """Per request: 1 where the worker proposes drafts after this step; 0 where none could be verified
        next (varlen on a curve where even certain drafts do not pay at this batch size), or without
        speculative decoding."""
    @property
    def entry_ratios(self) -> list[int]: ...
    def entry_writes(self, ratio: int) -> tuple[Int32Array, Int32Array]:
        """(rows, slots) of the compressed entries of ``ratio`` written this step."""
    @property
    def graph_size(self) -> int | None: ...
    @property
    def num_padding_rows(self) -> int: ...
    @property
    def block_copies(self) -> list[tuple[int, int]]: ...
    @property
    def state_copies(self) -> list[tuple[int, int]]: ...
    @property
    def outputs(self) -> list[RequestUpdate]:
        """Final outputs decided while scheduling (preemption in ``stop`` mode)."""

@final
class StepResult:
    """Per planned request: tokens produced (accepted drafts + 1; 0 for a non-final chunk)."""

    def __new__(
        cls,
        num_tokens: Sequence[int],
        token_ids: Sequence[int],
        num_draft_tokens: Sequence[int] | None = None,
        draft_token_ids: Sequence[int] | None = None,
        errors: Sequence[int] | None = None,
        draft_confidences: Sequence[float] | None = None,
    ) -> StepResult: ...
    @property
    def num_tokens(self) -> list[int]: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_draft_tokens(self) -> list[int]: ...
    @property
    def draft_token_ids(self) -> list[int]: ...
    @property
    def draft_confidences(self) -> list[float]:
        """Per draft: its chance of passing with every earlier draft of its request, in [0, 1]."""
    @property
    def errors(self) -> list[int]: ...

@final
class RequestUpdate:
    """The tokens one request gained in a step, and its end if it ended (the engine folds these into its
    ``RequestOutput``)."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def finish_reason(self) -> FinishReason | None: ...
    @property
    def stop_token_id(self) -> int | None: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_cached_tokens(self) -> int:
        """Positions the request's latest admission took from the prefix cache instead of computing them."""
    @property
    def finished(self) -> bool: ...

@final
class RequestState:
    """A snapshot of one live request."""

    @property
    def request_id(self) -> str: ...
    @property
    def token_ids(self) -> list[int]: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_inflight_tokens(self) -> int: ...
    @property
    def draft_token_ids(self) -> list[int]: ...
    @property
    def block_table(self) -> list[int]: ...
    @property
    def state_slot(self) -> int | None: ...
    @property
    def status(self) -> str: ...
    @property
    def schedulable(self) -> bool: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def priority(self) -> int: ...
    @property
    def tenant(self) -> str: ...
    @property
    def num_cached_tokens(self) -> int: ...

@final
class SchedulerStats:
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def num_free_state_slots(self) -> int: ...
    @property
    def num_total_state_slots(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def decode_step(self) -> int: ...
    @property
    def num_steps_in_flight(self) -> int: ...
    @property
    def num_deferred_blocks(self) -> int: ...
    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the prefix cache; those no request holds count in ``num_free_blocks``."""
    @property
    def num_state_snapshots(self) -> int: ...
    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache since the start."""
    @property
    def prefix_cache_hits(self) -> int:
        """Of those, tokens resumed from the cache instead of computed."""
    @property
    def num_prefill_tokens(self) -> int:
        """Prompt-chunk rows planned since the start."""

@final
class Scheduler:
    """``vote(value, op)`` is the data-parallel group's all-reduce of one bool, ``op`` "all" or
    "any"; leave it out for one rank."""

    def __new__(cls, config: SchedulerConfig, vote: Callable[[bool, str], bool] | None = None) -> Scheduler: ...
    @property
    def config(self) -> SchedulerConfig: ...
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int,
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = ...,
        schedulable: bool = True,
        constrained: bool = False,
        priority: int = 0,
        tenant: str = ...,
    ) -> None:
        """``tenant``: who the request is served for ("" by default): the queue goes first by the tenant
        served least, then priority, then arrival (docs/architecture.md, "The waiting queue's order")."""
    def set_schedulable(self, request_id: str, schedulable: bool = True) -> None: ...
    def mark_group_idle(self) -> None:
        """The group's work-left vote found no rank with work: the next ``schedule()`` of a NORMAL engine
        votes at an ANY point, so a lone rank's new prompt starts at once."""
    def schedule(self) -> StepPlan: ...
    def update(self, plan: StepPlan, result: StepResult) -> list[RequestUpdate]: ...
    def abort(self, request_id: str) -> RequestUpdate | None:
        """The final ``abort`` output, or None for an unknown or finished id (idempotent)."""
    def fork(
        self,
        parent_id: str,
        child_id: str,
        *,
        max_tokens: int,
        eos_token_id: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = ...,
    ) -> None: ...
    def set_step_cost(self, step_cost_ms: Mapping[int, float], sampler_ms: float = 0.0, measured: bool = True) -> None:
        """Varlen verification's step-cost curve: rows → step milliseconds, plus the sampler's per step.
        ``measured``: measured (or given), not a guess; only such a curve stops the draft from proposing
        (``StepPlan.propose_drafts``)."""
    def request(self, request_id: str) -> RequestState | None: ...
    def stats(self) -> SchedulerStats: ...
    def wants_prefill(self) -> bool: ...
    def has_unfinished(self) -> bool: ...
    def set_block_hashes(
        self,
        request_id: str,
        root: int,
        block_hashes: Sequence[int],
        image_spans: Sequence[tuple[int, int]] = ...,
        lookup: bool = True,
    ) -> None:
        """Prefix caching: a waiting request's hash chain root (``block_hash.root_hash``) and full-block hashes
        (``block_hash.block_hashes``), its image spans (first position, positions) and whether it may resume from
        the cache; before its prefill starts."""
    def add_block_hashes(self, request_id: str, block_hashes: Sequence[int]) -> None:
        """The hashes of the blocks a request's output filled since the last call."""
    def take_kv_events(self) -> tuple[list[int], list[int], bool]:
        """(stored, removed, cleared): the blocks that entered and left the prefix cache since the last call."""
    def clear_prefix_cache(self) -> None:
        """Drops every snapshot and the cache's hold on every cached block."""
    def block_ref_count(self, block_id: int) -> int: ...
    def check_invariants(self) -> None:
        """Raises AssertionError naming the first broken pool or queue invariant."""

@final
class VarlenPlan:
    @property
    def num_rows(self) -> int: ...
    @property
    def num_drafts(self) -> list[int]: ...
    @property
    def tokens_per_ms(self) -> float: ...

@final
class MtpVarlen:
    """Variable-length verification: rows from confidences and a step-cost curve (rows → ms)."""

    def __new__(cls, step_cost_ms: Mapping[int, float], sampler_ms: float = 0.0) -> MtpVarlen: ...
    def choose(self, confidences: Sequence[Sequence[float]]) -> VarlenPlan: ...

def graph_sizes(max_rows: int, interval: int = 8) -> list[int]: ...
def select_graph_size(sizes: Sequence[int], num_rows: int) -> int | None: ...

__all__ = [
    "BlockManager",
    "EngineType",
    "FinishReason",
    "Int32Array",
    "MtpVarlen",
    "PreemptionMode",
    "RequestUpdate",
    "RequestState",
    "Scheduling",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerStats",
    "StepPlan",
    "StepResult",
    "VarlenPlan",
    "graph_sizes",
    "select_graph_size",
]
