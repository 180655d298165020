"""kernels/ep_layout.py against the torch layouts (services/worker/parallel/exchange_layout.py): the send side's
blocks (rows, slot and weight bits, counts), returned picks and expert counts, and the receive side's whole
layout and slot counts, equal bit for bit; interpreted on the CPU, and compiled for sm_90a here."""

from __future__ import annotations

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from services.eplb.layout import startup_layout
from services.worker.parallel import exchange_layout
from services.worker.parallel.expert_slots import ExpertSlots
from services.worker.parallel.peer_buffers import PeerBuffers


def _picks(num_tokens: int, num_experts: int, top_k: int, seed: int, device: str = "cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    experts = torch.rand(num_tokens, num_experts, generator=gen, device=device).argsort(-1)[:, :top_k]
    return experts.to(torch.int32), torch.rand(num_tokens, top_k, generator=gen, device=device)


def _send(impl, buffers: PeerBuffers, x, experts, weights, live, slots: ExpertSlots, counted: bool):
    counts = torch.full((slots.table.shape[0],), 5, dtype=torch.long, device=x.device) if counted else None
    send = buffers.send
    picks = impl.send_layout(
        x,
        experts,
        weights,
        live,
        slots.table,
        slots.copies,
        slots.slots_per_rank,
        buffers.rows(send),
        buffers.meta(send),
        buffers.counts(send),
        counts,
    )
    return picks, counts


@pytest.mark.parametrize(
    ("num_tokens", "world", "redundant", "top_k", "live", "hidden"),
    [
        (1, 1, 0, 2, None, 40),  # one rank: every pick to itself
        (5, 2, 2, 2, "some", 40),  # copies of experts 0 and 1 (pairs alternate between them), a dead row
        (19, 3, 1, 6, None, 1100),  # three tiles of tokens, three chunks of columns
        (19, 4, 4, 6, "some", 40),
        (4, 2, 0, 2, "none", 40),  # a placeholder step: nothing goes anywhere
        (300, 2, 1, 2, "some", 16),  # the last tiles recount the earlier tokens in three steps of 128
    ],
)
def test_send_layout_equals_the_torch_send_layout(num_tokens, world, redundant, top_k, live, hidden):
    kernel = load_interpreted("ep_layout")
    num_experts = 12
    slots = ExpertSlots(startup_layout(num_experts, world, redundant), 0)
    experts, weights = _picks(num_tokens, num_experts, top_k, seed=num_tokens + world)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    mask = None
    if live == "some":
        mask = torch.rand(num_tokens, generator=torch.Generator().manual_seed(4)) < 0.7
    elif live == "none":
        mask = torch.zeros(num_tokens, dtype=torch.bool)
    got_buffers, want_buffers = (PeerBuffers.allocate(world, num_tokens * top_k, hidden, x.dtype, "cpu") for _ in "ab")
    for counted in (False, True):
        with interpreter():
            got, got_counts = _send(kernel, got_buffers, x, experts, weights, mask, slots, counted)
        want, want_counts = _send(exchange_layout, want_buffers, x, experts, weights, mask, slots, counted)
        assert got.dtype == want.dtype == torch.int64 and torch.equal(got, want)
        assert (got_counts is None) == (want_counts is None)
        assert got_counts is None or torch.equal(got_counts, want_counts)
        # What peers read: every byte of the blocks sent (the dump block is never sent).
        assert torch.equal(got_buffers.send[:world], want_buffers.send[:world])


def _received(
    world: int, rows_per_peer: int, hidden: int, num_slots: int, seed: int, device: str = "cpu"
) -> PeerBuffers:
    """A receive buffer as an exchange leaves it: each block's count, its rows' slots and weight bits, and
    arbitrary bytes past the count."""
    gen = torch.Generator().manual_seed(seed)
    buffers = PeerBuffers.allocate(world, rows_per_peer, hidden, torch.bfloat16, device)
    recv = buffers.recv
    recv.copy_(torch.randint(0, 256, recv.shape, generator=gen, dtype=torch.uint8))
    buffers.counts(recv).copy_(torch.randint(0, rows_per_peer + 1, (world, 1), generator=gen))
    meta = buffers.meta(recv)
    meta[..., 0] = torch.randint(0, num_slots, (world, rows_per_peer), generator=gen, dtype=torch.int32)
    meta[..., 1] = torch.rand(world, rows_per_peer, generator=gen).view(torch.int32)
    return buffers


@pytest.mark.parametrize(
    ("world", "rows_per_peer", "num_tokens", "num_slots", "live"),
    # (2, 72, 20, 48): 164 rows, one tile of 256 at 64 padded experts; (2, 150, 20, 48): 320 rows, two tiles.
    [
        (1, 4, 2, 8, None),
        (2, 10, 5, 5, "some"),
        (3, 24, 12, 17, None),
        (2, 72, 20, 48, "some"),
        (2, 150, 20, 48, "some"),
        (2, 6, 3, 4, "none"),
    ],
)
def test_received_layout_equals_the_torch_received_layout(world, rows_per_peer, num_tokens, num_slots, live):
    kernel = load_interpreted("ep_layout")
    buffers = _received(world, rows_per_peer, 16, num_slots, seed=world * 7 + num_slots)
    meta, received = buffers.meta(buffers.recv), buffers.counts(buffers.recv)
    mask = None
    if live == "some":
        mask = torch.rand(num_tokens, generator=torch.Generator().manual_seed(5)) < 0.6
    elif live == "none":
        mask = torch.zeros(num_tokens, dtype=torch.bool)
    capacity = world * num_tokens + world * rows_per_peer  # room for every row in one slot's expert
    for counted, shared_active in ((False, False), (True, True)):  # own rows after the blocks; then apart
        got_counts, want_counts = (torch.full((num_slots,), 2, dtype=torch.long) for _ in "ab")
        own_base = 0 if shared_active else world * buffers.block_rows
        args = (meta, received, mask, num_tokens, num_slots, capacity, buffers.block_rows, own_base)
        with interpreter():
            got = kernel.received_layout(*args, got_counts if counted else None, shared_active)
        want = exchange_layout.received_layout(*args, want_counts if counted else None, shared_active)
        assert set(got) == set(want)
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        assert torch.equal(got_counts, want_counts)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 64, 256])
@pytest.mark.parametrize("world", [1, 4])
def test_gpu_layouts_equal_the_torch_layouts_at_v41_shapes(num_tokens, world):
    """v41-s1's decode layer (48 experts top-6, hidden 5120) on ``world`` ranks with 4 redundant slots."""
    from kernels import ep_layout

    num_experts, top_k, hidden = 48, 6, 5120
    slots = ExpertSlots(startup_layout(num_experts, world, 4), 0, "cuda")
    experts, weights = _picks(num_tokens, num_experts, top_k, seed=num_tokens, device="cuda")
    x = torch.randn(num_tokens, hidden, device="cuda", dtype=torch.bfloat16)
    for live in (None, torch.rand(num_tokens, device="cuda") < 0.5):
        buffers = [PeerBuffers.allocate(world, num_tokens * top_k, hidden, x.dtype, "cuda") for _ in "ab"]
        got, got_counts = _send(ep_layout, buffers[0], x, experts, weights, live, slots, True)
        want, want_counts = _send(exchange_layout, buffers[1], x, experts, weights, live, slots, True)
        assert torch.equal(got, want) and torch.equal(got_counts, want_counts)
        assert torch.equal(buffers[0].send[:world], buffers[1].send[:world])
        recv = _received(world, num_tokens * top_k, hidden, slots.slots_per_rank, seed=world, device="cuda")
        args = (recv.meta(recv.recv), recv.counts(recv.recv), live, num_tokens, slots.slots_per_rank)
        for own_base, shared_active in ((0, True), (world * recv.block_rows, False)):
            rest = (world * num_tokens * top_k + num_tokens, recv.block_rows, own_base)  # random slots: room for all
            counts = [torch.zeros(slots.slots_per_rank, dtype=torch.long, device="cuda") for _ in "ab"]
            got = ep_layout.received_layout(*args, *rest, counts[0], shared_active)
            want = exchange_layout.received_layout(*args, *rest, counts[1], shared_active)
            for name in want:
                assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
            assert torch.equal(counts[0], counts[1])


def _compile_tool():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "compile_sm90.py"
    spec = importlib.util.spec_from_file_location("compile_sm90", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return tool


@pytest.mark.parametrize("flags", [True, False], ids=["masked-counted", "plain"])
def test_both_kernels_compile_for_sm90_on_this_cpu(flags, private_triton_cache):
    """The interpreter runs code the compiler rejects: Triton builds sm_90a code here, no device needed
    (scripts/dev/compile_sm90.py), at v41-s1's decode shapes (top-6, 48 experts, hidden 5120), with the live mask
    and the counts (and the shared expert counted active) or without."""
    from kernels import ep_layout as m

    tool = _compile_tool()
    send = dict(
        x_ptr="*bf16",
        experts_ptr="*i32",
        weights_ptr="*fp32",
        live_ptr="*i1",
        table_ptr="*i64",
        copies_ptr="*i64",
        rows_ptr="*bf16",
        meta_ptr="*i32",
        sent_ptr="*i64",
        picks_ptr="*i64",
        expert_counts_ptr="*i64",
        num_tokens="i32",
        hidden="i32",
        x_stride="i32",
        rows_stride="i64",
        meta_stride="i64",
        sent_stride="i64",
        table_width="i32",
        slots_per_rank="i32",
        capacity="i32",
        world="i32",
    )
    const = dict(
        TOP_K=6, K_PAD=8, W_PAD=2, BLOCK_T=m.SEND_BLOCK_T, SCAN_T=128, BLOCK_D=128, CHUNK_D=512, LIVE=flags, COUNT=flags
    )
    _, report = tool.compile_sm90(m._send_kernel, send, const, divisible=())
    assert "registers" in report
    received = dict(
        meta_ptr="*i32",
        received_ptr="*i64",
        live_ptr="*i1",
        counts_ptr="*i32",
        row_ids_ptr="*i32",
        route_w_ptr="*fp32",
        slot_of_ptr="*i64",
        active_ptr="*i32",
        num_active_ptr="*i32",
        slot_counts_ptr="*i64",
        num_tokens="i32",
        rows_per_peer="i32",
        meta_stride="i64",
        received_stride="i64",
        capacity="i32",
        world="i32",
        block_rows="i32",
        own_base="i32",
    )
    const = dict(NUM_SLOTS=48, E_PAD=64, BLOCK_R=256, BLOCK_FILL=1024, LIVE=flags, COUNT=flags, SHARED_ACTIVE=flags)
    _, report = tool.compile_sm90(m._received_kernel, received, const, num_warps=8, divisible=())
    assert "registers" in report
