"""Engine defaults, in one place.

- ``max_model_len``: when ``LLM`` is not given one, the smaller of the model's positions and what the block pool
  holds for one request (``default_max_model_len``); where the pools are sized from it instead (a CPU engine
  without ``num_blocks``) at most 4,096. Logged at start. ``EngineConfig`` alone keeps 4,096.
- ``SamplingParams.max_tokens`` unset: the rest of the context.
- ``first_n_no_eos``: 0 (DeepInfer uses 1); the forced top-k is off.
- Logprobs are those of the processed distribution: after the bias, bans, penalties, min-p, forced top-k,
  temperature, top-k and top-p, renormalised (DeepInfer's choice). They are not raw-model logprobs unless no processing
  applies.
- ``n > 1``: the prompt prefilled once as a prefix and forked into the choices (docs/serving.md, "Sampling
  parameters in the engine").
- ``scheduling``: "mixed" (decode rows and prompt chunks in one step under ``max_num_batched_tokens``, 2,048).
- ``async_scheduling``: off. When on, the engine plans step N+1 before it updates step N (one step in
  flight, counted as fully accepted); the worker fills N+1's pending inputs from N's sampled tokens. Decode and
  mixed steps stay in flight: a prefill step (or an empty one) is updated at once (drained). Tokens and
  logprobs are the same either way (tests/services/engine/test_async.py), with drafts too (the worker's
  seqlen fix-up; tests/services/worker/spec/test_speculator.py).
- ``num_speculative_tokens``: 0 (off). When on, each decode step verifies that many DSpark drafts per
  request (fixed, 1 + n rows each) on the torch model or the kernel backend, with or without async
  scheduling; with CUDA graphs every decode step replays one, verify steps included (graph sizes count
  rows); ``spec_sampling`` "rejection";
  ``spec_varlen`` off (on: the scheduler picks each request's drafts from their confidences and the
  step-cost curve, measured from the engine's decode steps unless ``spec_step_cost_ms`` gives one).
- Probability mass is summed as integers, floor(p · 2³¹); a draw's position is the index of the token
  being produced (the sampler's contract).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from services.worker.config import WorkerConfig

DEFAULT_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class EngineConfig:
    """Knobs of one engine replica. Pool sizes of None are derived from the others."""

    # Prompt plus output tokens of one request.
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    # Tokens per paged block (DeepInfer: 128).
    block_size: int = 128
    # Paged blocks including the null block 0; None = room for max_num_seqs full-length requests (resolved_num_blocks).
    num_blocks: int | None = None
    # State slots including the null slot 0; None = max_num_seqs + 1.
    num_state_slots: int | None = None
    # Requests running or in prefill at once.
    max_num_seqs: int = 16
    # Rows per step (the token budget): under "mixed" scheduling every decode row (with its drafts) first, then
    # prompt chunks cut to the rest; under "separate" the prompt tokens of a prefill step.
    max_num_batched_tokens: int = 2048
    # "mixed": decode rows and prompt chunks share a step, so an arriving prompt never stalls the running
    # streams (docs/architecture.md, "Mixed steps"); "separate": DeepInfer's prompt-or-decode steps, picked by
    # the data-parallel vote.
    scheduling: str = "mixed"
    # "stop" (end the victim with `preempted`) or "recompute" (prefill it again later).
    preemption_mode: str = "stop"
    # The end token is banned for a request's first this-many output tokens.
    first_n_no_eos: int = 0
    # Keep only the top this-many logits before any other processing; None = off.
    forced_top_k: int | None = None
    # Seed of the built-in preset's random weights.
    model_seed: int = 0
    # Where the model runs: "cpu", "cuda" or "cuda:N"; None = not resolved here (LLM resolves it: cuda when
    # available, else cpu; services/engine/device.py, which also makes the kernel backend, CUDA graphs and
    # async scheduling the CUDA defaults).
    device: str | None = None
    # Never capture CUDA graphs, even where they are the default (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # Fraction of the GPU's memory the engine may hold (model, activations, pools); on CUDA, with num_blocks
    # None, the block pool is sized from it after one profiled step (services/engine/pool_sizing.py).
    gpu_memory_utilization: float = 0.9
    # "auto": the checkpoint's weights (a preset's from model_seed); "dummy": random weights for the model's
    # config drawn from model_seed on the device, nothing read from the checkpoint's tensors (vLLM's name).
    load_format: str = "auto"
    # Plan step N+1 while step N runs (one decode or mixed step in flight); off = schedule, execute, update in turn.
    async_scheduling: bool = False
    # The worker's GPU kernel backend (services/worker/kernel_model/backend.py): None = the torch model (CPU or GPU),
    # "fp8" = Triton kernels with FP8 weights and activations, "fp32" = the same kernels with fp32 weights.
    kernel_backend: str | None = None
    # On a CUDA device with the kernel backend, decode steps replay captured CUDA graphs (one per graph size,
    # services/worker/runners/decode_step_graphs.py); other steps run eagerly. Needs kernel_backend (the torch MoE
    # syncs).
    cuda_graphs: bool = False
    # Every per-row result independent of the other rows in the step and of the row's place
    # (model/batch_invariant.py on the CPU's torch path; kernels/invariance.py on the kernel backend):
    # the same request gives bit-identical tokens and logprobs alone, in any batch, with async
    # scheduling on or off, and (CPU) chunked at any budget.
    batch_invariant: bool = False
    # Engram tables in host shared memory (one copy per host, mapped by every rank), each step's rows
    # gathered into a pinned buffer and copied to the device (services/worker/state/engram_host.py).
    engram_on_host: bool = False
    # How the kernel backend keeps the routed experts: "fp4" = MXFP4 as released, dequantised in the grouped
    # GEMM's registers (services/worker/kernel_model/fp4_experts.py; the CUDA default, services/engine/device.py);
    # "fp8" = converted to FP8 at load.
    expert_format: str = "fp8"
    # Speculative decoding with the model's DSpark draft (docs/speculative.md): drafts verified per request
    # and step, 0 = off (at most the draft's block size).
    num_speculative_tokens: int = 0
    # How drafts are accepted: "rejection" (speculative sampling) or "deterministic" (position-keyed
    # coupling: a seeded request's tokens do not depend on how many drafts were verified).
    spec_sampling: str = "rejection"
    # Data-parallel ranks (docs/parallelism.md): N rank processes, each with its own scheduler, worker and
    # caches, in lockstep; their routed experts spread over the ranks (expert parallelism). 1 = one process.
    data_parallel_size: int = 1
    # At least this many extra copies of routed experts over the ranks, rounded up so every rank holds
    # the same number of slots (DeepInfer's rounding); copies go to experts 0, 1, 2, … at start-up.
    num_redundant_experts: int = 0
    # Seconds any collective between ranks may wait for a peer before the rank fails with an error.
    rank_timeout_s: float = 60.0
    # Variable-length verification (scheduler_rs MtpVarlen): each decode step verifies, per request, the
    # prefix of its drafts worth its rows, ranked by the draft's confidence head against the step-cost
    # curve; off: every request verifies num_speculative_tokens drafts.
    spec_varlen: bool = False
    # Varlen's step-cost curve as ((rows, milliseconds), ...) pairs; None = measured from the engine's own
    # decode steps (services/engine/step_cost.py).
    spec_step_cost_ms: tuple[tuple[int, float], ...] | None = None
    # Prefix caching (docs/architecture.md, "Prefix caching"): full blocks stay cached by content hash, and
    # state snapshots let a request resume after a cached prefix; the same bits as without it in the
    # batch-invariant mode.
    enable_prefix_caching: bool = True
    # State snapshots prefix caching keeps (each the bytes of a state slot, plus at most one block); None =
    # 4 · max_num_seqs with prefix caching (a request saves up to three while it prefills and one when it ends),
    # 0 without.
    num_state_snapshots: int | None = None
    # Before the LLM is built, synthetic requests run every kernel variant a step can take, so no live step waits on
    # a Triton compile (services/engine/warmup.py). The CUDA default with the kernel backend
    # (services/engine/device.py).
    warmup: bool = False

    def __post_init__(self) -> None:
        for name in ("max_model_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.scheduling not in ("mixed", "separate"):
            raise ValueError(f"scheduling must be 'mixed' or 'separate', got {self.scheduling!r}")
        decode_rows = self.max_num_seqs * (1 + self.num_speculative_tokens)
        if self.scheduling == "mixed" and self.max_num_batched_tokens < decode_rows:
            raise ValueError(
                f"max_num_batched_tokens {self.max_num_batched_tokens} cannot hold a mixed step's decode rows: "
                f"max_num_seqs {self.max_num_seqs} × (1 + num_speculative_tokens {self.num_speculative_tokens}) = "
                f"{decode_rows}; raise --max-num-batched-tokens, lower --max-num-seqs, or use --scheduling separate"
            )
        if self.preemption_mode not in ("stop", "recompute"):
            raise ValueError(f"preemption_mode must be 'stop' or 'recompute', got {self.preemption_mode!r}")
        if self.first_n_no_eos < 0:
            raise ValueError("first_n_no_eos must be >= 0")
        if self.kernel_backend not in (None, "fp8", "fp32"):
            raise ValueError(f"kernel_backend must be None, 'fp8' or 'fp32', got {self.kernel_backend!r}")
        if self.cuda_graphs and self.kernel_backend is None:
            raise ValueError("cuda_graphs needs kernel_backend ('fp8' or 'fp32'): the torch MoE cannot be captured")
        if self.forced_top_k is not None and self.forced_top_k < 1:
            raise ValueError("forced_top_k must be positive or None")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.expert_format not in ("fp4", "fp8"):
            raise ValueError(f"expert_format must be 'fp4' or 'fp8', got {self.expert_format!r}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.spec_sampling not in ("rejection", "deterministic"):
            raise ValueError(f"spec_sampling must be 'rejection' or 'deterministic', got {self.spec_sampling!r}")
        if self.num_speculative_tokens and self.async_scheduling and self.first_n_no_eos:
            raise ValueError(
                "first_n_no_eos with speculative decoding needs async_scheduling off: the end-token ban "
                "counts the step in flight's tokens, which drafts make unknown until it is read"
            )
        if self.spec_varlen and not self.num_speculative_tokens:
            raise ValueError("spec_varlen needs num_speculative_tokens > 0: it chooses how many drafts to verify")
        if self.spec_step_cost_ms is not None and not self.spec_varlen:
            raise ValueError("spec_step_cost_ms is varlen's step-cost curve: set spec_varlen=True with it")
        if self.spec_step_cost_ms is not None and (
            not self.spec_step_cost_ms
            or any(rows < 1 or not ms > 0 or ms == float("inf") for rows, ms in self.spec_step_cost_ms)
        ):
            raise ValueError(
                f"spec_step_cost_ms needs (rows ≥ 1, finite milliseconds > 0) pairs, got {self.spec_step_cost_ms!r}"
            )
        if self.enforce_eager and self.cuda_graphs:
            raise ValueError("enforce_eager=True and cuda_graphs=True contradict each other")
        if self.num_state_snapshots is not None and self.num_state_snapshots < 0:
            raise ValueError(f"num_state_snapshots must be >= 0, got {self.num_state_snapshots}")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be at least 1, got {self.data_parallel_size}")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if not self.rank_timeout_s > 0:
            raise ValueError(f"rank_timeout_s must be positive, got {self.rank_timeout_s}")
        if self.data_parallel_size > 1 and self.kernel_backend not in (None, "fp8"):
            raise ValueError(
                "data_parallel_size > 1 on the kernel backend runs its FP8 form (docs/parallelism.md): pass "
                f"kernel_backend 'fp8', not {self.kernel_backend!r}"
            )

    def resolved_num_blocks(self) -> int:
        """The null block, plus room for max_num_seqs full-length requests admitted one after another
        under the scheduler's prefill gate (a new prompt starts only while ≤ 90% of the blocks are
        held): the last one arrives with (max_num_seqs − 1) · per_request held. Without the 10%
        headroom, the last tenth of a full batch waited until others finished (the step bench ran 60 of 64)."""
        if self.num_blocks is not None:
            return self.num_blocks
        per_request = -(-self.max_model_len // self.block_size)
        gated = -(-(self.max_num_seqs - 1) * per_request * 10 // 9)  # ⌈(n − 1) · p / 0.9⌉
        return max(self.max_num_seqs * per_request, gated) + 1

    def resolved_num_state_slots(self) -> int:
        return self.num_state_slots if self.num_state_slots is not None else self.max_num_seqs + 1

    def resolved_num_state_snapshots(self) -> int:
        if not self.enable_prefix_caching:
            return 0
        return self.num_state_snapshots if self.num_state_snapshots is not None else 4 * self.max_num_seqs

    def num_worker_state_slots(self) -> int:
        """State slots the worker holds: the request slots (null slot included), then the snapshots."""
        return self.resolved_num_state_slots() + self.resolved_num_state_snapshots()

    def replace(self, **changes: object) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def worker_config(self) -> WorkerConfig:
        """The worker's share of this configuration, pool sizes resolved."""
        return WorkerConfig(
            block_size=self.block_size,
            num_blocks=self.resolved_num_blocks(),
            num_state_slots=self.num_worker_state_slots(),
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            kernel_backend=self.kernel_backend,
            batch_invariant=self.batch_invariant,
            engram_on_host=self.engram_on_host,
            expert_format=self.expert_format,
            cuda_graphs=self.cuda_graphs,
            num_speculative_tokens=self.num_speculative_tokens,
            spec_sampling=self.spec_sampling,
        )


def default_max_model_len(config: EngineConfig, model_max: int) -> int:
    """The smaller of the model's positions and the tokens the block pool holds for one request (the null
    block excluded); with the pool sized from max_model_len instead (``num_blocks`` None), at most 4,096."""
    if config.num_blocks is None:
        return min(model_max, DEFAULT_MAX_MODEL_LEN)
    return min(model_max, (config.num_blocks - 1) * config.block_size)
