"""What the worker needs to know of the engine's configuration, and no more.

The engine owns the user-facing knobs (``services.engine.config.EngineConfig``) and the rules that derive
pool sizes from them; it hands the worker this resolved record (``EngineConfig.worker_config()``). The
worker never imports the engine's config: sizes arrive here already decided, so the worker's pools and
the scheduler's block accounting are built from one set of numbers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class WorkerConfig:
    """The worker's pools and backend; every size resolved (no None)."""

    # Tokens per paged block.
    block_size: int
    # Paged blocks including the null block 0.
    num_blocks: int
    # State slots including the null slot 0.
    num_state_slots: int
    # Prompt plus output tokens of one request: bounds a request's block table (CUDA-graph buffers).
    max_model_len: int
    # Requests per step at most: the largest decode graph (times 1 + drafts) and draft bucket captured.
    max_num_seqs: int
    # None = the torch model; "fp8" or "fp32" = the Triton kernel backend (services/worker/kernel_model/backend.py).
    kernel_backend: str | None = None
    # Every per-row result independent of the step's other rows (model/batch_invariant.py on the CPU torch
    # path, kernels/invariance.py on the kernel backend).
    batch_invariant: bool = False
    # Engram tables in host shared memory, one copy per host that every rank maps; a step copies only its
    # rows to the device (services/worker/state/engram_host.py).
    engram_on_host: bool = False
    # Routed experts on the kernel backend: "fp4" (MXFP4 as released) or "fp8" (converted at load).
    expert_format: str = "fp8"
    # Decode steps (and, with drafts, the proposal and verify) replay CUDA graphs captured before serving.
    cuda_graphs: bool = False
    # DSpark drafts verified per request and step (0: no speculator).
    num_speculative_tokens: int = 0
    # How drafts are accepted: "rejection" sampling or "deterministic" position-keyed coupling.
    spec_sampling: str = "rejection"

    def __post_init__(self) -> None:
        for name in ("block_size", "num_blocks", "num_state_slots", "max_model_len", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.kernel_backend not in (None, "fp8", "fp32"):
            raise ValueError(f"kernel_backend must be None, 'fp8' or 'fp32', got {self.kernel_backend!r}")
