"""The expert-parallel MoE layer over real gloo groups: each rank's tokens get, bit for bit, what the
single-process ``MoE`` gives them in the batch-invariant mode (2 and 4 ranks, with expert copies, in fp32
and bf16), a rank in a placeholder step still joins every exchange, and counts arrive per physical slot."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.distributed as dist

from model.batch_invariant import batch_invariant
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.presets import TINY
from services.worker.parallel.ep_moe import ExpertParallel, ExpertParallelMoE
from services.worker.parallel.exchange import Exchange
from services.worker.parallel.expert_slots import ExpertSlots
from tests.ranks_harness import run_ranks

NUM_TOKENS = 24


def _moe_and_tokens(dtype: torch.dtype) -> tuple[MoE, torch.Tensor]:
    """The same random layer and tokens on every rank (one seed), the router's bias spread so that picks vary."""
    torch.manual_seed(0)
    moe = MoE(dataclasses.replace(TINY, swiglu_limit=10.0))
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe.to(dtype), torch.randn(NUM_TOKENS, TINY.hidden_size).to(dtype)


def _one_process(dtype: torch.dtype) -> tuple[np.ndarray, np.ndarray]:
    moe, x = _moe_and_tokens(dtype)
    counts = torch.zeros(TINY.n_routed_experts, dtype=torch.long)
    with torch.no_grad(), batch_invariant():
        return moe(x.unsqueeze(0), counts)[0].float().numpy(), counts.numpy()


CASES = [(torch.float32, 0, None), (torch.bfloat16, 2, None), (torch.float32, 0, 1)]
"""(dtype, at least this many expert copies, the rank in a placeholder step or None), one after another on
the same two ranks (one spawn)."""


def _ep_rank(rank: int, world_size: int, init_method: str) -> list[dict]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    group = dist.new_group(backend="gloo")
    results = []
    try:
        for dtype, num_redundant, idle_rank in CASES:
            moe, x = _moe_and_tokens(dtype)
            slots = ExpertSlots.startup(TINY.n_routed_experts, world_size, num_redundant, rank)
            parallel = ExpertParallel(Exchange(group, world_size), [slots])
            layer = ExpertParallelMoE(moe, 0, parallel)
            mine = torch.arange(rank, NUM_TOKENS, world_size)  # this rank's tokens: every world_size-th
            counts = torch.zeros(TINY.n_routed_experts, dtype=torch.long)
            with torch.no_grad(), batch_invariant():
                if rank == idle_rank:  # a placeholder step: one fake row, routed nowhere, still exchanging
                    with parallel.placeholder():
                        layer(x[:1].unsqueeze(0), counts)
                    out = None
                else:
                    out = layer(x[mine].unsqueeze(0), counts)[0].float().numpy()
            results.append(
                {
                    "tokens": mine.numpy(),
                    "out": out,
                    "counts": counts.numpy(),
                    "local_experts": slots.local_experts,
                    "slot_counts": parallel.take_slot_counts()[0].numpy(),
                    "num_slots": moe.w1.shape[0],
                }
            )
        return results
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_ranks(_ep_rank, 2, tmp_path_factory.mktemp("ep"))


@pytest.mark.parametrize("case", [0, 1], ids=["fp32", "bf16-copies"])
def test_each_rank_gets_the_single_process_outputs(two_ranks, case):
    dtype, num_redundant, _ = CASES[case]
    expected, expected_counts = _one_process(dtype)
    ranks = [r[case] for r in two_ranks]
    received = np.zeros(TINY.n_routed_experts, dtype=np.int64)
    for r in ranks:
        assert r["num_slots"] == (TINY.n_routed_experts + num_redundant) // 2  # only this rank's slots are kept
        assert np.array_equal(r["out"], expected[r["tokens"]])
        np.add.at(received, r["local_experts"], r["slot_counts"])
    assert np.array_equal(sum(r["counts"] for r in ranks), expected_counts)  # sending side, logical
    assert np.array_equal(received, expected_counts)  # receiving side, per physical slot
    if num_redundant:  # rank 1's last two slots are copies of experts 0 and 1, and serve pairs
        assert ranks[1]["local_experts"][-2:] == [0, 1] and ranks[1]["slot_counts"][-2:].sum() > 0


def test_a_placeholder_rank_routes_nothing_and_its_peer_is_unchanged(two_ranks):
    expected, _ = _one_process(torch.float32)
    ranks = [r[2] for r in two_ranks]
    assert np.array_equal(ranks[0]["out"], expected[ranks[0]["tokens"]])
    assert ranks[1]["counts"].sum() == 0  # the fake row counted nothing and sent nothing
    received = sum(r["slot_counts"].sum() for r in ranks)
    assert received == len(ranks[0]["tokens"]) * TINY.num_experts_per_tok
