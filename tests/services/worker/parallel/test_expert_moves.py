"""The move plan of an EPLB layout change: each new slot's source, the same on every rank. And the moves of the
kernel backend's stacks over two gloo ranks (``LiveLayouts``, two versions in turn): every slot of both ranks
holds its new expert's FP8 codes and block scales, or MXFP4 codes and e8m0 bytes, as the unsharded ``KernelMoE``
holds them, the shared expert untouched, in the same tensors at the same addresses as before the moves (what
CUDA graphs captured on them read), the slot maps rewritten in place."""

from __future__ import annotations

import dataclasses
import importlib
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from model.deepseek_v41.moe import MoE
from model.deepseek_v41.presets import TINY
from services.eplb.layout import Layout, startup_layout
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.moe import KernelMoE
from services.worker.parallel.ep_kernel_moe import ExpertParallelKernelMoE
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.parallel.expert_moves import apply_layouts, changed_slots, move_plan
from services.worker.parallel.expert_slots import ExpertSlots
from services.worker.parallel.live_layouts import BoundaryVote, LayoutUpdate, LiveLayouts
from tests.ranks_harness import run_ranks

CFG = dataclasses.replace(TINY, swiglu_limit=10.0)  # hidden 64, 8 routed experts
STACKS = ("w13", "w13_scale", "w2", "w2_scale")
# Start-up with 2 copies: rank 0 holds experts 0-4, rank 1 holds 5, 6, 7, 0, 1. Then two moves in turn, the
# second starting from the first's stacks in force: peer copies both ways, own slots reordered, a copy dropped.
MOVES = [
    Layout((7, 0, 3, 3, 5, 6, 1, 2, 4, 0), num_gpus=2, num_logical=8),
    Layout((4, 6, 0, 1, 2, 3, 5, 7, 7, 0), num_gpus=2, num_logical=8),
]


def test_own_copies_stay_and_others_come_from_the_lowest_holder():
    old = startup_layout(8, 2, 2)  # slots 0-9: experts 0-7, then copies of 0 and 1; rank 1 holds 5, 6, 7, 0, 1
    new = Layout((7, 0, 3, 3, 5, 6, 1, 2, 4, 0), num_gpus=2, num_logical=8)
    # Rank 0 keeps 0 and 3 (3 twice), takes 7 and 5 from rank 1; rank 1 keeps 6, 1 and 0, takes 2 and 4 from rank 0.
    assert move_plan(old, new) == [[1, 0, 0, 0, 1], [1, 1, 0, 0, 1]]
    assert changed_slots(old, new, 0) == [0, 1, 2, 4] and changed_slots(old, new, 1) == [0, 1, 2, 3, 4]


def test_a_layout_over_other_ranks_is_refused():
    with pytest.raises(ValueError, match="cannot replace"):
        move_plan(startup_layout(8, 2, 0), startup_layout(8, 4, 0))
    with pytest.raises(ValueError, match="cannot replace"):
        ExpertSlots.startup(8, 2, 0, 0).assign(startup_layout(8, 2, 2))


def _moe() -> MoE:
    torch.manual_seed(0)
    moe = MoE(CFG)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe


def _kernels() -> KernelSet:
    """The kernel modules (never launched here: the stacks are only built and moved)."""
    names = ("rmsnorm", "quant_fp8", "moe_router", "moe_grouped_gemm", "decode_attention")
    return KernelSet(
        *(importlib.import_module(f"kernels.{n}") for n in names), moe_fp4=importlib.import_module("kernels.moe_fp4")
    )


def _stacks(moe: KernelMoE) -> dict[str, torch.Tensor]:
    holder = moe if moe.fp4 is None else moe.fp4
    return {n: getattr(holder, n) for n in STACKS}


def test_a_kernel_layer_refuses_another_number_of_slots_before_anything_moves():
    slots = ExpertSlots.startup(CFG.n_routed_experts, 2, 0, 0)
    parallel = ExpertParallel(None, [slots])  # type: ignore[arg-type]
    layer = ExpertParallelKernelMoE(KernelMoE(_moe(), "fp8", _kernels(), "fp8"), 0, parallel)
    model = SimpleNamespace(layers=[SimpleNamespace(ffn=layer)])
    with pytest.raises(ValueError, match="layer 0's layout has 10 expert slots; the kernel layer keeps its 8"):
        apply_layouts(model, parallel, [MOVES[0]], group=None)  # type: ignore[arg-type]
    assert slots.layout == startup_layout(8, 2, 0)


def _move_rank(rank: int, world_size: int, init_method: str) -> dict:
    """On a rank: each expert format's stacks built, sharded to the start-up slots, then moved live by ``MOVES``,
    both started at one boundary (the second waits for the first to be in force); returns the stacks' bytes,
    whether every address stayed, the slot maps and the experts received."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    group = dist.new_group(backend="gloo")
    out = {}
    try:
        for expert_format in ("fp8", "fp4"):
            slots = ExpertSlots.startup(CFG.n_routed_experts, world_size, 2, rank)
            parallel = ExpertParallel(None, [slots])  # type: ignore[arg-type]
            layer = ExpertParallelKernelMoE(KernelMoE(_moe(), "fp8", _kernels(), expert_format), 0, parallel)
            assert (layer.moe.fp4 is None) == (expert_format == "fp8")
            tensors = [*_stacks(layer.moe).values(), slots.table, slots.copies]
            addresses = [t.data_ptr() for t in tensors]
            live = LiveLayouts([layer], parallel, group)
            try:
                for version, layout in enumerate(MOVES, start=1):
                    assert live.receive(LayoutUpdate(version, {0: layout}))
                live.at_boundary(BoundaryVote(received=2, staged=0))  # starts both moves
                for version in (1, 2):
                    deadline = time.monotonic() + 30
                    while live.local().staged < version and live.error is None and time.monotonic() < deadline:
                        time.sleep(0.01)
                    if version == 1:  # the second move starts from the stacks with the first in force: it waits
                        time.sleep(0.2)
                    assert live.error is None and live.local().staged == version
                    assert live.at_boundary(BoundaryVote(received=2, staged=version)) == [version]
            finally:
                live.close()
            out[expert_format] = {
                "stacks": {n: t.view(torch.uint8).numpy().copy() for n, t in _stacks(layer.moe).items()},  # bytes
                "same_addresses": [t.data_ptr() for t in tensors] == addresses,
                "experts": slots.local_experts,
                "table": slots.table.numpy().copy(),
                "received": live.num_received_from_peers,
            }
        return out
    finally:
        dist.destroy_process_group()


def test_live_moves_put_each_slots_fp8_and_fp4_expert_in_place(tmp_path):
    ranks = run_ranks(_move_rank, 2, tmp_path, timeout_s=120)
    final = MOVES[-1]
    for expert_format in ("fp8", "fp4"):
        full = _stacks(KernelMoE(_moe(), "fp8", _kernels(), expert_format))
        for rank, got in enumerate(r[expert_format] for r in ranks):
            experts = list(final.phy2log[rank * 5 : (rank + 1) * 5])
            assert got["experts"] == experts and got["same_addresses"], (expert_format, rank)
            for name in STACKS:
                want = full[name].view(torch.uint8).numpy()
                assert np.array_equal(got["stacks"][name][:5], want[experts]), (expert_format, rank, name)
                if expert_format == "fp8":  # the shared expert, stacked last, stays
                    assert np.array_equal(got["stacks"][name][5], want[CFG.n_routed_experts]), (rank, name)
            assert np.array_equal(got["table"], ExpertSlots(final, rank).table.numpy())
        # Peer copies: rank 0 takes 7, 5 then 4, 6, 1, 2; rank 1 takes 2, 4 then 3, 5, 7, 7 (move_plan of each move).
        assert [r[expert_format]["received"] for r in ranks] == [6, 6]
