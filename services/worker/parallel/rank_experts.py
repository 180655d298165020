"""One rank's share of the routed experts: the start-up layout of every MoE layer's physical slots over
the group, and the model's MoE layers sharded to this rank's slots, exchanging over the group's exchange
group. The same for a rank whose worker runs in the engine's process (services/engine/parallel/rank.py)
and for a worker process of its own (`python -m services.entrypoints.worker --dp N`, services/worker/service.py).

On the torch backend the layers are sharded here (``ExpertParallelMoE``). On the kernel backend the runner
converts the model first and then shards each ``KernelMoE`` (``shard_kernel_experts``,
services/worker/parallel/ep_kernel_moe.py), whose exchange is the fixed-shape ``GroupPeerExchange`` with
``max_num_seqs × (1 + drafts)`` tokens per pass (the largest decode step: one pass), the passes of longer
steps agreed on the vote's host group.
"""

from __future__ import annotations

from model.deepseek_v41.model import DeepseekV41
from services.worker.config import WorkerConfig
from services.worker.parallel.ep_moe import ExpertParallel, shard_experts
from services.worker.parallel.exchange import Exchange
from services.worker.parallel.expert_slots import ExpertSlots
from services.worker.parallel.groups import RankGroups
from services.worker.parallel.peer_exchange import GroupPeerExchange


def shard_over_group(
    model: DeepseekV41, groups: RankGroups, num_redundant_experts: int, device: str, config: WorkerConfig
) -> ExpertParallel:
    """This rank's start-up slots of every layer; on the torch backend ``model``'s MoE layers sharded in place
    to them. Returns the runner's handle."""
    cfg = model.cfg
    slots = [
        ExpertSlots.startup(cfg.n_routed_experts, groups.world_size, num_redundant_experts, groups.rank, device)
        for _ in range(cfg.num_hidden_layers)
    ]
    exchange = Exchange(groups.exchange, groups.world_size)
    if config.kernel_backend is None:
        parallel = ExpertParallel(exchange, slots)
        shard_experts(model, parallel)
        return parallel
    return ExpertParallel(
        exchange,
        slots,
        peer=GroupPeerExchange(groups.exchange, groups.world_size),
        host=groups.vote,
        pass_tokens=config.max_num_seqs * (1 + config.num_speculative_tokens),
    )
