"""The kernel backend's expert-parallel MoE layer against the unsharded ``KernelMoE``, in the batch-invariant mode:
every rank's tokens get ``KernelMoE``'s outputs bit for bit.

CPU (the kernels interpreted): N virtual ranks in one process, whose exchange is device copies through the same
fixed-capacity buffers, with expert copies, dead rows, a rank in a placeholder step and steps of several passes.
GPU (``gpu``-marked, compiled kernels): the same virtual ranks captured in one CUDA graph and replayed on new
tokens; and one rank over NCCL at world size 1 (the real ``all_to_all_single``) captured and replayed.

After an EPLB move (each rank's stacks given its new experts' FP8 or MXFP4 codes and scales through
``put_expert_weights``, its slot map rewritten in place) the layer still gives ``KernelMoE``'s outputs, and the
rows arrive at the new layout's slots: on the CPU eagerly, on the GPU by replaying the graph captured before the
move (no recapture).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch

from kernels import invariance
from kernels.reference import route_metadata
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.presets import TINY
from services.eplb.layout import Layout
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.moe import KernelMoE
from services.worker.parallel.ep_kernel_moe import ExpertParallelKernelMoE, ep_layer
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.parallel.exchange_layout import local_layout
from services.worker.parallel.expert_moves import changed_slots
from services.worker.parallel.expert_slots import ExpertSlots
from services.worker.parallel.peer_exchange import GroupPeerExchange, VirtualPeerExchange

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
CFG = dataclasses.replace(TINY, swiglu_limit=10.0)  # hidden 64, 8 routed experts, top-2
# 2 ranks, 10 slots (start-up: experts 0-7, copies of 0 and 1): a move trading experts both ways, reordering
# own slots and changing which experts have copies.
MOVED = Layout((7, 0, 3, 3, 5, 6, 1, 2, 4, 0), num_gpus=2, num_logical=8)


def _moe(device: str) -> MoE:
    """One random layer, the router's weights spread so that picks vary (one seed: the same on every rank)."""
    torch.manual_seed(0)
    moe = MoE(CFG)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.5)
    return moe.to(device)


def _kernels(device: str, layouts: str = "kernels"):
    """(kernel set, the context its calls run in): interpreted copies on the CPU, compiled on CUDA. ``layouts``
    "torch": the set without ``ep_layout``, so the layer's layouts run as torch ops (exchange_layout.py)."""
    if device == "cpu":
        from kernels.interpret import interpreter, load_interpreted

        names = ("rmsnorm", "quant_fp8", "moe_router", "moe_grouped_gemm", "decode_attention")
        fp4 = load_interpreted("moe_fp4")
        ep = load_interpreted("ep_layout") if layouts == "kernels" else None
        return KernelSet(
            *(load_interpreted(n) for n in names), moe_fp4=fp4, ep_layout=ep, interpreted=True
        ), interpreter
    kernels = KernelSet.compiled()
    return (kernels if layouts == "kernels" else dataclasses.replace(kernels, ep_layout=None)), contextlib.nullcontext


def _ranks(
    moe: MoE, kernels: KernelSet, world: int, redundant: int, pass_tokens: int, exchange, expert_format: str = "fp8"
) -> list:
    layers = []
    for rank in range(world):
        slots = ExpertSlots.startup(CFG.n_routed_experts, world, redundant, rank, moe.w1.device)
        parallel = ExpertParallel(None, [slots], peer=exchange, pass_tokens=pass_tokens)  # type: ignore[arg-type]
        layers.append(ExpertParallelKernelMoE(KernelMoE(moe, "fp8", kernels, expert_format), 0, parallel))
    return layers


@pytest.mark.parametrize(
    ("world", "redundant", "passes", "expert_format", "layouts"),
    # 4 ranks: 10 slots (copies of experts 0 and 1), rounded to 3 a rank; two passes. MXFP4 routed experts. The
    # layouts as torch ops (the kernel set without ep_layout) once per expert format.
    [
        (2, 0, 1, "fp8", "kernels"),
        (4, 2, 2, "fp8", "kernels"),
        (2, 1, 1, "fp4", "kernels"),
        (4, 2, 2, "fp8", "torch"),
        (2, 1, 1, "fp4", "torch"),
    ],
)
def test_virtual_ranks_equal_the_unsharded_layer(world, redundant, passes, expert_format, layouts):
    moe = _moe("cpu")
    kernels, context = _kernels("cpu", layouts)
    tokens = 5  # per rank; rank 0 has a dead row; the last rank is in a placeholder step
    pass_tokens = -(-tokens // passes)
    layers = _ranks(moe, kernels, world, redundant, pass_tokens, VirtualPeerExchange(world), expert_format)
    x = torch.randn(world, tokens, CFG.hidden_size)
    lives: list = [None] * world
    lives[0] = torch.tensor([True, False, True, True, True])
    counts = [torch.zeros(CFG.n_routed_experts, dtype=torch.long) for _ in range(world)]
    for layer in layers:
        layer.parallel.passes = passes
    layers[-1].parallel.routes_nothing = True
    with torch.no_grad(), context(), invariance.fixed_configs():
        ref_counts = torch.zeros(CFG.n_routed_experts, dtype=torch.long)
        ref = KernelMoE(moe, "fp8", kernels, expert_format)(x[:-1].reshape(1, -1, CFG.hidden_size), ref_counts)[0]
        outs = ep_layer(layers, [x[r][None] for r in range(world)], counts, lives, [None] * world)
    ref = ref.view(world - 1, tokens, -1)
    for rank in range(world - 1):
        live = torch.ones(tokens, dtype=torch.bool) if lives[rank] is None else lives[rank]
        assert torch.equal(outs[rank][0][live], ref[rank][live]), f"rank {rank}"
        assert torch.equal(outs[rank][0][~live], torch.zeros_like(outs[rank][0][~live]))
    assert torch.equal(outs[-1], torch.zeros_like(outs[-1]))  # the placeholder rank's rows route nowhere
    # Logical counts: every live pick once, where it was routed; the unsharded layer's less the dead row's picks.
    dead = KernelMoE(moe, "fp8", kernels)
    dead_counts = torch.zeros_like(ref_counts)
    with torch.no_grad(), context(), invariance.fixed_configs():
        dead(x[0, 1:2][None], dead_counts)
    assert torch.equal(sum(counts), ref_counts - dead_counts)
    # Per physical slot where the rows arrived: every live pick exactly once.
    assert sum(int(layer.parallel.take_slot_counts().sum()) for layer in layers) == int(sum(counts).sum())


def _move(layers: list, full: KernelMoE, new: Layout) -> None:
    """Each virtual rank's layer to ``new``: its new experts' stacks (from the unsharded layer's) written in, as
    ``LiveLayouts`` puts a move's weights in force, and its slot map rewritten."""
    stacks = full if full.fp4 is None else full.fp4
    for rank, layer in enumerate(layers):
        slots = layer.parallel.slots[0]
        changed = changed_slots(slots.layout, new, rank)
        experts = torch.tensor(
            [new.phy2log[rank * slots.slots_per_rank + k] for k in changed], device=stacks.w13.device
        )
        layer.put_expert_weights(
            tuple(getattr(stacks, n)[experts] for n in ("w13", "w13_scale", "w2", "w2_scale")), changed
        )
        slots.assign(new)


def _arrivals_by_expert(layers: list) -> torch.Tensor:
    """Rows that arrived at every rank's slots since the last take, summed by the expert each slot holds now."""
    got = torch.zeros(CFG.n_routed_experts, dtype=torch.long)
    for layer in layers:
        slots = layer.parallel.slots[0]
        got.index_add_(0, torch.tensor(slots.local_experts), layer.parallel.take_slot_counts()[0].cpu())
    return got


@pytest.mark.parametrize("expert_format", ["fp8", "fp4"])
def test_virtual_ranks_after_a_move_equal_the_unsharded_layer(expert_format):
    moe = _moe("cpu")
    kernels, context = _kernels("cpu")
    tokens = 4
    layers = _ranks(moe, kernels, 2, 2, tokens, VirtualPeerExchange(2), expert_format)
    full = KernelMoE(moe, "fp8", kernels, expert_format)
    addresses = [t.data_ptr() for layer in layers for t in layer.expert_weights()]
    x = torch.randn(2, tokens, CFG.hidden_size)
    with torch.no_grad(), context(), invariance.fixed_configs():
        ref_counts = torch.zeros(CFG.n_routed_experts, dtype=torch.long)
        ref = full(x.reshape(1, -1, CFG.hidden_size), ref_counts)[0].view(2, tokens, -1)
        ep_layer(layers, [x[r][None] for r in range(2)], [None, None], [None, None], [None, None])
        _arrivals_by_expert(layers)
        _move(layers, full, MOVED)
        outs = ep_layer(layers, [x[r][None] for r in range(2)], [None, None], [None, None], [None, None])
    for rank in range(2):
        assert torch.equal(outs[rank][0], ref[rank]), f"rank {rank}"
    assert torch.equal(_arrivals_by_expert(layers), ref_counts)  # read by the new layout: rows went to its slots
    assert [t.data_ptr() for layer in layers for t in layer.expert_weights()] == addresses


def test_local_layout_is_the_route_metadata_of_the_valid_rows():
    gen = torch.Generator().manual_seed(1)
    choice = torch.randint(0, 4, (12,), generator=gen)
    weight = torch.rand(12, generator=gen)
    valid = torch.rand(12, generator=gen) > 0.3
    got = local_layout(choice, weight, valid, 4, 12)
    idx = torch.where(valid)[0]
    want = route_metadata(choice[idx, None], weight[idx, None], 4, capacity=12)
    assert torch.equal(got["counts"], want["counts"])
    assert torch.equal(got["active"], want["active"]) and torch.equal(got["num_active"], want["num_active"])
    for e in range(4):
        n = int(want["counts"][e])
        assert torch.equal(idx[want["row_ids"][e, :n].long()], got["row_ids"][e, :n].long())
        assert torch.equal(got["route_w"][e, :n], want["route_w"][e, :n])
    assert torch.equal(got["slot_of"][idx], want["slot_of"]) and not got["slot_of"][~valid].any()


def test_peer_exchanges_refuse_mismatched_tensors():
    exchange = VirtualPeerExchange(2)
    with pytest.raises(ValueError, match="one send and one receive"):
        exchange.all_to_all([torch.zeros(2, 3)], [torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=r"one shape \[2, C"):
        exchange.all_to_all([torch.zeros(2, 3), torch.zeros(2, 3)], [torch.zeros(2, 3), torch.zeros(3, 3)])
    sends = [torch.arange(6.0).view(2, 3), torch.arange(6.0, 12.0).view(2, 3)]
    recvs = [torch.zeros(2, 3), torch.zeros(2, 3)]
    exchange.all_to_all(sends, recvs)
    assert recvs[0].tolist() == [[0, 1, 2], [6, 7, 8]] and recvs[1].tolist() == [[3, 4, 5], [9, 10, 11]]


# ---------------------------------------------------------------- GPU: captured in CUDA graphs


def _graph_against_unsharded(
    layers: list,
    moe: MoE,
    kernels: KernelSet,
    tokens: int,
    dtype: torch.dtype,
    expert_format: str = "fp8",
    moved: Layout | None = None,
) -> None:
    """Captures ``ep_layer`` over ``layers`` (their exchange: virtual copies or NCCL) on static inputs, then replays
    it on three draws of tokens and live masks, each against ``KernelMoE`` on the same tokens with ``==``. With
    ``moved``, the layers move to it after the first draw, and the rows of the later ones arrive at its slots."""
    world = len(layers)
    device = moe.w1.device
    x = torch.zeros(world, tokens, CFG.hidden_size, dtype=dtype, device=device)
    live = torch.ones(world, tokens, dtype=torch.bool, device=device)
    counts = torch.zeros(world, CFG.n_routed_experts, dtype=torch.long, device=device)

    def run() -> list[torch.Tensor]:
        counts.zero_()
        return ep_layer(
            layers, [x[r][None] for r in range(world)], list(counts), [live[r] for r in range(world)], [None] * world
        )

    with torch.no_grad(), invariance.fixed_configs():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()  # warm-up: compiles, allocates the buffers
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = run()
        unsharded = KernelMoE(moe, "fp8", kernels, expert_format)
        gen = torch.Generator(device=device).manual_seed(3)
        for draw in range(3):
            x.copy_(torch.randn(x.shape, generator=gen, device=device).to(dtype))
            live.fill_(True)
            if draw:
                live[0, draw] = False  # a dead row on rank 0
            if moved is not None and draw == 1:
                _move(layers, unsharded, moved)  # into the captured buffers: the graph is replayed as it is
            _arrivals_by_expert(layers)
            graph.replay()
            ref_counts = torch.zeros(CFG.n_routed_experts, dtype=torch.long, device=device)
            ref = unsharded(x.reshape(1, -1, CFG.hidden_size), ref_counts, live.reshape(1, -1))[0].view(
                world, tokens, -1
            )
            for r in range(world):
                assert torch.equal(outs[r][0], ref[r]), f"draw {draw}, rank {r}"
            assert torch.equal(counts.sum(0), ref_counts)
            assert torch.equal(_arrivals_by_expert(layers), ref_counts.cpu())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(("world", "expert_format"), [(2, "fp8"), (4, "fp8"), (2, "fp4")])
def test_virtual_ranks_captured_in_a_graph_equal_the_unsharded_layer(world, expert_format):
    moe = _moe("cuda")
    kernels, _ = _kernels("cuda")
    tokens = 8
    layers = _ranks(moe, kernels, world, 2, tokens, VirtualPeerExchange(world), expert_format)
    _graph_against_unsharded(layers, moe, kernels, tokens, torch.bfloat16, expert_format)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("expert_format", ["fp8", "fp4"])
def test_a_move_into_the_captured_buffers_replays_without_a_recapture(expert_format):
    moe = _moe("cuda")
    kernels, _ = _kernels("cuda")
    tokens = 8
    layers = _ranks(moe, kernels, 2, 2, tokens, VirtualPeerExchange(2), expert_format)
    _graph_against_unsharded(layers, moe, kernels, tokens, torch.bfloat16, expert_format, moved=MOVED)


@gpu
@pytest.mark.gpu
def test_nccl_at_world_size_one_captured_in_a_graph(tmp_path):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        group = dist.new_group(backend="nccl")
        moe = _moe("cuda")
        kernels, _ = _kernels("cuda")
        tokens = 8
        layers = _ranks(moe, kernels, 1, 0, tokens, GroupPeerExchange(group, 1))
        _graph_against_unsharded(layers, moe, kernels, tokens, torch.bfloat16)
    finally:
        dist.destroy_process_group()
