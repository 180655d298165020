"""Size the block pool from ``gpu_memory_utilization`` (vLLM's rule), before the graphs are captured.

On CUDA, with ``num_blocks`` unset, the engine runs one profiled step first: a throwaway eager engine on
the same model, with pools just large enough, prefills the longest chunk the scheduler can plan
(``min(max_num_batched_tokens, max_model_len − 1)`` tokens, the largest activation). Its peak allocated
memory, less those probe pools, plus what lives outside torch's allocator (CUDA context, cuBLAS and
Triton workspaces), is what the engine needs besides its pools. The block pool gets what is left of
``total × gpu_memory_utilization`` after the state slots and ``GRAPH_RESERVE_BYTES`` for the decode
graphs' memory pool (captured afterwards, on the final pools' addresses).

Prefix caching's state snapshots are state slots too. Unless ``num_state_snapshots`` is given, their count
(4 · max_num_seqs) is capped by bytes: at most ``SNAPSHOT_SHARE`` of what is left for the pools beside the
request slots, so a large ``max_num_seqs`` does not take the block pool's room for snapshots (at v41-s1 a
snapshot is a 2.9 MB slot, 25.6 blocks' bytes).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

from services.engine.config import EngineConfig

log = logging.getLogger("shinkai.engine.pools")

GRAPH_RESERVE_BYTES = 2 << 30
"""Kept free for the CUDA graphs' shared memory pool (decode activations at the largest graph size)."""

SNAPSHOT_SHARE = 0.1
"""The largest share of the pools' bytes (blocks and snapshots) the default snapshot count may take."""


@dataclass(frozen=True)
class PoolPlan:
    """The pools one engine gets and what they were sized from (all bytes)."""

    num_blocks: int  # paged blocks, the null block included
    num_state_slots: int  # state slots, the null slot and the snapshots included
    block_bytes: int  # one block
    slot_bytes: int  # one state slot
    model_bytes: int  # the model's parameters and buffers on the device
    peak_step_bytes: int  # the profiled step's peak besides its pools (model included)
    budget_bytes: int  # total × gpu_memory_utilization
    block_size: int  # tokens per block
    num_state_snapshots: int = 0  # of the state slots, those prefix caching's snapshots hold

    @property
    def max_tokens(self) -> int:
        """Token positions the block pool holds across all requests (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    def describe(self, max_model_len: int) -> str:
        return (
            f"model {self.model_bytes / 2**30:.1f} GiB, profiled step peak {self.peak_step_bytes / 2**30:.1f} GiB "
            f"of a {self.budget_bytes / 2**30:.1f} GiB budget; pools: {self.num_blocks} blocks "
            f"({self.num_blocks * self.block_bytes / 2**30:.2f} GiB, {self.max_tokens} tokens), "
            f"{self.num_state_slots} state slots ({self.num_state_slots * self.slot_bytes / 2**30:.2f} GiB, "
            f"{self.num_state_snapshots} of them snapshots); "
            f"longest context that fits: {min(max_model_len, self.max_tokens)} tokens"
        )


def plan_blocks(
    budget_bytes: int,
    peak_step_bytes: int,
    block_bytes: int,
    slot_bytes: int,
    num_state_slots: int,
    graph_reserve_bytes: int = GRAPH_RESERVE_BYTES,
) -> int:
    """Blocks that fit in what the budget leaves (may be ≤ 0: the caller refuses)."""
    free = budget_bytes - peak_step_bytes - num_state_slots * slot_bytes - graph_reserve_bytes
    return free // block_bytes


def plan_snapshots(pools_bytes: int, slot_bytes: int, max_count: int) -> int:
    """The default snapshot count: ``max_count`` (4 · max_num_seqs), or fewer where their bytes would pass
    ``SNAPSHOT_SHARE`` of ``pools_bytes`` (what is left for blocks and snapshots)."""
    return max(0, min(max_count, int(SNAPSHOT_SHARE * pools_bytes) // slot_bytes))


def size_pools(
    source, config: EngineConfig, probe_engine, fit_max_model_len: bool = False
) -> tuple[EngineConfig, PoolPlan]:
    """``config`` with ``num_blocks`` set from the profiled step (see the module docstring). ``probe_engine``
    builds the throwaway engine (an ``LLM``) on ``source`` from an EngineConfig. ``fit_max_model_len``: the
    config's max_model_len is the model's, to be cut to what the pools hold (the caller does): the pools need
    only hold one request of max_num_batched_tokens."""
    import torch

    from services.engine.sampling_params import SamplingParams
    from services.worker.state.cache_engine import cache_bytes

    device = torch.device(config.device or "cuda")
    cfg = source.config
    block_bytes, slot_bytes = cache_bytes(cfg, config.block_size, config.num_speculative_tokens)
    num_slots = config.num_worker_state_slots()
    prompt_len = min(config.max_num_batched_tokens, config.max_model_len - 1)
    probe_blocks = -(-(prompt_len + 1) // config.block_size) + 1
    probe = config.replace(
        num_blocks=probe_blocks,
        num_state_slots=2,
        max_num_seqs=1,
        cuda_graphs=False,
        async_scheduling=False,
        enable_prefix_caching=False,
    )
    model_bytes = sum(  # on the device only: Engram tables kept on the host are not its
        t.numel() * t.element_size()
        for t in [*source.model.parameters(), *source.model.buffers()]
        if t is not None and t.device.type == device.type
    )
    gc.collect()  # an engine dropped earlier in this process holds its pools until a collection
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    llm = probe_engine(probe)
    prompt = [cfg.bos_token_id, *((100 + i) % cfg.vocab_size for i in range(prompt_len - 1))]
    try:
        llm.generate([prompt], SamplingParams(max_tokens=1))
    except torch.OutOfMemoryError as err:
        raise ValueError(
            f"a step of {prompt_len} rows (the token budget, --max-num-batched-tokens "
            f"{config.max_num_batched_tokens}) does not fit the GPU beside the model: lower "
            "--max-num-batched-tokens"
        ) from err
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - probe_blocks * block_bytes - 2 * slot_bytes
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside = max(0, total - free - torch.cuda.memory_reserved(device))  # context, workspaces: not torch's
    budget = int(total * config.gpu_memory_utilization)
    if config.num_state_snapshots is None and config.enable_prefix_caching:
        request_slots = config.resolved_num_state_slots()
        pools_bytes = budget - (peak + outside) - request_slots * slot_bytes - GRAPH_RESERVE_BYTES
        snapshots = plan_snapshots(pools_bytes, slot_bytes, config.resolved_num_state_snapshots())
        config = config.replace(num_state_snapshots=snapshots)
        num_slots = config.num_worker_state_slots()
    num_blocks = plan_blocks(budget, peak + outside, block_bytes, slot_bytes, num_slots)
    fitted = min(config.max_model_len, config.max_num_batched_tokens) if fit_max_model_len else config.max_model_len
    needed = -(-fitted // config.block_size) + 1
    if num_blocks < needed:
        raise ValueError(
            f"not enough GPU memory for one request of max_model_len={config.max_model_len}: "
            f"{total * config.gpu_memory_utilization / 2**30:.1f} GiB budget, the model and one step "
            f"take {(peak + outside) / 2**30:.1f} GiB, leaving room for {max(num_blocks, 0)} blocks "
            f"of the {needed} needed; raise --gpu-memory-utilization or lower --max-model-len"
        )
    plan = PoolPlan(
        num_blocks,
        num_slots,
        block_bytes,
        slot_bytes,
        model_bytes,
        peak + outside,
        budget,
        config.block_size,
        config.resolved_num_state_snapshots(),
    )
    log.info("%s", plan.describe(config.max_model_len))
    return config.replace(num_blocks=num_blocks), plan
