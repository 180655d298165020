"""One rank's share of the routed experts: the start-up layout of every MoE layer's physical slots over
the group, and the model's MoE layers sharded to this rank's slots, exchanging over the group's exchange
group. The same for a rank whose worker runs in the engine's process (services/engine/parallel/rank.py)
and for a worker process of its own (`python -m services.entrypoints.worker --dp N`, services/worker/service.py)."""

from __future__ import annotations

from model.deepseek_v41.model import DeepseekV41
from services.worker.parallel.ep_moe import ExpertParallel, shard_experts
from services.worker.parallel.exchange import Exchange
from services.worker.parallel.expert_slots import ExpertSlots
from services.worker.parallel.groups import RankGroups


def shard_over_group(model: DeepseekV41, groups: RankGroups, num_redundant_experts: int, device: str) -> ExpertParallel:
    """Shards ``model``'s MoE layers in place to this rank's start-up slots; returns the runner's handle."""
    cfg = model.cfg
    slots = [
        ExpertSlots.startup(cfg.n_routed_experts, groups.world_size, num_redundant_experts, groups.rank, device)
        for _ in range(cfg.num_hidden_layers)
    ]
    parallel = ExpertParallel(Exchange(groups.exchange, groups.world_size), slots)
    shard_experts(model, parallel)
    return parallel
