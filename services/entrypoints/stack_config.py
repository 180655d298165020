"""The settings of a Shinkai stack: which model, how many engines and ranks, its ports, and each service's
flags. `services()` (services/entrypoints/service_list.py) turns them into the processes; `up`
(services/entrypoints/stack.py) and the compose and Kubernetes generators read them too."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.admission import AdmissionLimits
from services.gateway.http_timeouts import HttpTimeouts


@dataclass(frozen=True)
class StackConfig:
    model: str = "tiny"  # checkpoint directory or preset name
    num_engines: int = 1  # independent engine replicas
    data_parallel_size: int = 1  # >1: the engine is this many ranks in lockstep, one process each (EP MoE)
    num_redundant_experts: int = 0  # extra expert copies over the ranks (EngineConfig.num_redundant_experts)
    host: str = "127.0.0.1"  # every service binds here (loopback)
    http_port: int = 8000  # the gateway's OpenAI HTTP port; 0: any free port
    grpc_port: int = 50051  # the gateway's shinkai.v1 port; 0: any free port
    nats_port: int = 0  # 0: any free port
    run_dir: Path = field(default_factory=lambda: Path.home() / ".cache" / "shinkai" / "stack")  # logs + PIDs
    max_num_seqs: int | None = None  # per engine; None: the engine default
    max_model_len: int | None = None  # prompt plus output tokens per request; None: the engine default
    # EngineConfig device fields passed to each engine (or its remote worker) as flags: device,
    # enforce_eager, async_scheduling, gpu_memory_utilization, load_format (services/engine/device.py).
    device_args: tuple[tuple[str, object], ...] = ()
    remote_workers: bool = False  # each engine's worker in its own process (worker.v1) instead of in-process
    batch_invariant: bool = False  # engines and workers in batch-invariant mode (EngineConfig.batch_invariant)
    engram_on_host: bool = False  # Engram tables in host shared memory (EngineConfig.engram_on_host)
    num_speculative_tokens: int = 0  # DSpark drafts per request and step (EngineConfig.num_speculative_tokens)
    spec_sampling: str = "rejection"  # EngineConfig.spec_sampling
    spec_varlen: bool = False  # EngineConfig.spec_varlen
    # EngineConfig step fields passed to each engine as flags: max_num_batched_tokens, scheduling, prefix caching
    # (step_args).
    step_args: tuple[tuple[str, object], ...] = ()
    drain_timeout_s: float | None = None  # engines' and gateway's grace period on SIGTERM; None: their default
    allow_private_image_urls: bool = False  # the gateway fetches image URLs resolving to private addresses too
    supervise: bool = True  # `up` leaves a supervisor that restarts crashed services (supervisor.py)
    restart_limit: int = 4  # the supervisor's restarts in a row per service; the next crash stays down
    restart_backoff_s: float = 1.0  # the supervisor's wait before a first restart (doubled for each in a row)
    http_timeouts: HttpTimeouts = HttpTimeouts()  # the gateway's read deadlines of a request's headers and body
    admission: AdmissionLimits = AdmissionLimits()  # the gateway's per-tenant limits (services/gateway/admission.py)
