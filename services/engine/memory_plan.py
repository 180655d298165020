"""Whether a model fits the device before it is loaded, and where its bytes went after.

``estimate`` adds up, from the config alone (the checkpoint's tensor table), what an engine on the kernel
backend needs on the device: the weights in the form the backend keeps them (FP8 projections at 128×128
scales; the routed experts MXFP4 as released or converted to FP8, by ``expert_format``; the Engram tables
unless ``engram_on_host``; small tensors in fp32, the head in bf16), the largest step's activations (one
prefill chunk through a MoE pass), the smallest pools that serve (one ``max_model_len`` request's blocks and
the ``max_num_seqs`` state slots) and a reserve (the decode graphs' pool, the CUDA context and workspaces).
``check`` refuses, before any byte is loaded, a configuration whose sum exceeds ``total ×
gpu_memory_utilization``, naming the GiB needed and available and the flags that would help. It is an
estimate: where it passes, the pools are still sized from a profiled step (services/engine/pool_sizing.py),
and running out there is reported the same way (``out_of_memory``), never as a CUDA traceback.

``device_bytes_by_part`` is the measured side: the loaded model's bytes per part and device, logged at start.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from model.deepseek_v41.checkpoint import tensor_table
from model.deepseek_v41.config import ModelConfig
from services.engine.config import EngineConfig
from services.engine.pool_sizing import GRAPH_RESERVE_BYTES

log = logging.getLogger("shinkai.engine.memory")

GiB = 2**30
CONTEXT_BYTES = 1 << 30
"""The CUDA context, cuBLAS and Triton workspaces: memory outside torch's allocator (about 0.6 GiB measured on
an H100 with torch 2.11; rounded up)."""
MOE_PASS_TOKENS = 8192
"""Tokens per MoE pass (services/worker/kernel_model/moe.py ``MOE_MAX_TOKENS``)."""
ACTIVATION_ROW_FLOATS = 64
"""fp32 values per hidden channel and token that a prefill step holds at its peak besides the MoE pass (the mHC
streams, attention's q and kv, the residual and norm outputs): an allowance, not a measured peak."""


class NotEnoughMemory(ValueError):
    """A configuration that does not fit the device, with what it needs and what would help."""


def _padded(n: int) -> int:
    return -(-n // 128) * 128


@dataclass(frozen=True)
class MemoryEstimate:
    """Device bytes an engine needs, by part (see the module docstring)."""

    dense_bytes: int  # every weight but the routed experts and the Engram tables, as the backend keeps them
    expert_bytes: int  # the routed experts in expert_format
    engram_bytes: int  # the Engram tables on the device (0 with engram_on_host)
    engram_host_bytes: int  # the Engram tables in host memory (0 without engram_on_host)
    activation_bytes: int  # the largest step's activations
    pool_bytes: int  # one max_model_len request's blocks plus max_num_seqs state slots
    reserve_bytes: int  # decode graphs' pool (with CUDA graphs) and the CUDA context
    expert_bytes_fp4: int  # the routed experts as MXFP4 (what --expert-format fp4 would take)

    @property
    def weight_bytes(self) -> int:
        return self.dense_bytes + self.expert_bytes + self.engram_bytes

    @property
    def needed_bytes(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.pool_bytes + self.reserve_bytes

    def describe(self) -> str:
        host = f", Engram tables on the host {self.engram_host_bytes / GiB:.1f} GiB" if self.engram_host_bytes else ""
        return (
            f"needs {self.needed_bytes / GiB:.1f} GiB on the device: weights {self.weight_bytes / GiB:.1f} GiB "
            f"(routed experts {self.expert_bytes / GiB:.1f}, Engram tables {self.engram_bytes / GiB:.1f}, the rest "
            f"{self.dense_bytes / GiB:.1f}), activations {self.activation_bytes / GiB:.1f}, minimum pools "
            f"{self.pool_bytes / GiB:.2f}, reserve {self.reserve_bytes / GiB:.1f}{host}"
        )


def estimate(cfg: ModelConfig, config: EngineConfig) -> MemoryEstimate:
    """The device bytes ``config`` needs for ``cfg`` on the kernel backend (module docstring)."""
    from services.worker.state.cache_engine import cache_bytes

    dense = experts = experts_fp4 = engram = 0
    for spec in tensor_table(cfg).values():
        rows, cols = (spec.shape[0], spec.shape[1]) if len(spec.shape) == 2 else (1, spec.shape[0])
        numel = 1
        for s in spec.shape:
            numel *= s
        fp8 = _padded(rows) * _padded(cols) * (1 + 4 / (128 * 128)) * (numel // (rows * cols))
        if spec.fmt == "mxfp4":
            fp4 = _padded(rows) * _padded(cols) * (0.5 + 1 / 32)
            experts_fp4 += int(fp4)
            experts += int(fp4 if config.expert_format == "fp4" else fp8)
        elif spec.fmt == "fp8_rowwise":
            engram += int(numel * (1 + 1 / 32))
        elif spec.fmt == "fp8_block":
            dense += int(fp8)
        else:
            dense += numel * (2 if spec.name == "head.weight" else 4)
    block_bytes, slot_bytes = cache_bytes(cfg, config.block_size, config.num_speculative_tokens)
    chunk = min(config.max_num_batched_tokens, config.max_model_len)
    moe_tokens = min(chunk, MOE_PASS_TOKENS)
    stacked = cfg.n_routed_experts + 1
    moe = stacked * moe_tokens * (_padded(cfg.hidden_size) + _padded(cfg.moe_intermediate_size)) * 2
    activations = moe + chunk * cfg.hidden_size * 4 * ACTIVATION_ROW_FLOATS
    num_blocks = -(-config.max_model_len // config.block_size) + 1
    pools = num_blocks * block_bytes + config.num_worker_state_slots() * slot_bytes
    reserve = CONTEXT_BYTES + (GRAPH_RESERVE_BYTES if config.cuda_graphs else 0)
    on_host = config.engram_on_host
    return MemoryEstimate(
        dense, experts, 0 if on_host else engram, engram if on_host else 0, activations, pools, reserve, experts_fp4
    )


def check(plan: MemoryEstimate, config: EngineConfig, total_bytes: int, name: str) -> None:
    """Raise ``NotEnoughMemory`` when ``plan`` exceeds ``total_bytes × gpu_memory_utilization``."""
    budget = int(total_bytes * config.gpu_memory_utilization)
    if plan.needed_bytes <= budget:
        return
    raise NotEnoughMemory(
        f"model {name} does not fit this device: it {plan.describe()}; "
        f"{budget / GiB:.1f} GiB are available ({total_bytes / GiB:.1f} GiB × gpu_memory_utilization "
        f"{config.gpu_memory_utilization}). What helps: {'; '.join(remedies(plan, config))}"
    )


def remedies(plan: MemoryEstimate, config: EngineConfig) -> list[str]:
    """The flags that would lower ``plan``'s need, each with what it saves."""
    out = []
    if plan.engram_bytes:
        out.append(f"--engram-on-host (the Engram tables' {plan.engram_bytes / GiB:.1f} GiB go to host memory)")
    if config.expert_format == "fp8":
        saved = plan.expert_bytes - plan.expert_bytes_fp4
        out.append(f"--expert-format fp4 (routed experts kept MXFP4: {saved / GiB:.1f} GiB less)")
    if config.max_num_seqs > 1:
        out.append(f"fewer --max-num-seqs (now {config.max_num_seqs}: each one a state slot)")
    out.append(f"a shorter --max-model-len (now {config.max_model_len}: the minimum pools and the longest step)")
    if config.gpu_memory_utilization < 0.95:
        out.append(f"a higher --gpu-memory-utilization (now {config.gpu_memory_utilization})")
    return out


def out_of_memory(
    plan: MemoryEstimate | None, config: EngineConfig, stage: str, error: BaseException
) -> NotEnoughMemory:
    """The clear error for a CUDA out-of-memory during ``stage`` (loading, profiling), the estimate beside it."""
    said = "" if plan is None else f" The estimate: it {plan.describe()}."
    helps = "" if plan is None else f" What helps: {'; '.join(remedies(plan, config))}"
    first = str(error).splitlines()[0] if str(error) else type(error).__name__
    return NotEnoughMemory(f"the device ran out of memory while {stage} ({first}).{said}{helps}")


def device_bytes_by_part(model) -> dict[str, dict[str, int]]:
    """{part: {device type: bytes}} of a loaded model's parameters and buffers; parts: ``routed experts``,
    ``Engram tables``, ``the rest``."""
    out: dict[str, dict[str, int]] = {}
    seen: set[int] = set()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        if ".engram.embed." in name or name.endswith("engram.embed.weight"):
            part = "Engram tables"
        elif (
            ".ffn." in name
            and (".w13" in name or ".w2" in name or ".w1" in name or ".w3" in name)
            and "shared" not in name
        ):
            part = "routed experts"
        else:
            part = "the rest"
        where = out.setdefault(part, {})
        where[t.device.type] = where.get(t.device.type, 0) + t.numel() * t.element_size()
    return out


def log_device_bytes(model) -> None:
    """One log line per part of ``device_bytes_by_part``."""
    for part, where in device_bytes_by_part(model).items():
        log.info("model memory: %s %s", part, ", ".join(f"{b / GiB:.2f} GiB on {d}" for d, b in sorted(where.items())))
