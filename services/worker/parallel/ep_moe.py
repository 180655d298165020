"""The expert-parallel MoE layer: one rank's part of a layer whose routed experts are spread over ranks.

Each rank keeps its own tokens (data-parallel attention). Per layer: route locally (the model's router),
send each (token, pick) pair to the rank that holds a copy of its expert (``Exchange.dispatch``), run the
experts of this rank's slots on what arrived, send the outputs back (``Exchange.combine``), and sum each
token's outputs in fp32 in the model's fixed order: the shared expert (always local) first, then the
routed picks in top-k order (model/deepseek_v41/moe.py). Every expert computes exactly what the
single-process MoE computes for that row, so in the batch-invariant mode a token's output has the same
bits whichever rank holds its experts and whatever else is in the step.

Expert counts are taken where the rows arrive, per physical slot (``slot_counts``); the sending side still
adds its logical counts to the layer's ``counts`` (the engine's expert loads).

``ExpertParallel`` is what the runner holds: the exchange, every layer's slots, and the placeholder
switch. During a placeholder step (an idle rank's one fake row) every pair is dropped before dispatch:
the row routes to no expert, and the rank still makes every call of the exchange.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.moe import MoE, clamped_swiglu
from services.worker.parallel.exchange import Exchange
from services.worker.parallel.expert_slots import ExpertSlots
from services.worker.parallel.peer_buffers import PeerBuffers
from services.worker.parallel.peer_exchange import PeerExchange


class ExpertParallel:
    """The runner's handle on expert parallelism: the exchange, slots per layer, slot counts; for the kernel
    backend's layer (services/worker/parallel/ep_kernel_moe.py) also its fixed-shape exchange, its buffers and
    the step's number of passes."""

    def __init__(
        self,
        exchange: Exchange,
        slots: list[ExpertSlots],
        *,
        peer: PeerExchange | None = None,
        host: dist.ProcessGroup | None = None,
        pass_tokens: int = 1,
    ) -> None:
        self.exchange = exchange
        self.slots = slots  # one per layer
        self.routes_nothing = False  # True during a placeholder step
        # The kernel layer's all-to-all of fixed-shape blocks (None: the torch layer's ``exchange`` only).
        self.peer = peer
        # The host (gloo) group on which the ranks agree on each step's passes (None: one rank, or virtual ranks).
        self.host = host
        # Tokens per pass of the kernel layer: the buffers hold pass_tokens × top-k rows per peer.
        self.pass_tokens = pass_tokens
        # Passes every rank runs in the current step (agree_passes; 1 outside an agreed step).
        self.passes = 1
        self._agreed = False
        self._buffers: PeerBuffers | None = None
        # [layers, slots per rank] int64 on the slots' device (no sync per layer): pairs received per local
        # physical slot, since the last take.
        self.slot_counts = torch.zeros(
            len(slots), slots[0].slots_per_rank, dtype=torch.long, device=slots[0].table.device
        )

    @contextlib.contextmanager
    def placeholder(self) -> Iterator[None]:
        """A placeholder step: its rows route to no expert."""
        self.routes_nothing = True
        try:
            yield
        finally:
            self.routes_nothing = False

    def agree_passes(self, num_tokens: int) -> int:
        """Once per step, before it runs, on every rank: the group's most passes of ``pass_tokens`` any rank's
        step needs (a host all-reduce on ``host``), which every rank then runs; later calls in the same step
        return it. ``end_step`` clears it."""
        if not self._agreed:
            need = torch.tensor([max(1, -(-num_tokens // self.pass_tokens))], dtype=torch.long)
            if self.host is not None:
                dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self.host)
            self.passes, self._agreed = int(need.item()), True
        return self.passes

    def end_step(self) -> None:
        self.passes, self._agreed = 1, False

    def buffers_for(self, hidden: int, dtype: torch.dtype, top_k: int, out_width: int | None = None) -> PeerBuffers:
        """The kernel layer's send and receive buffers (every layer's, in turn), made on first use (an eager
        step or a capture's warm-up, never inside a capture) for rows of ``hidden`` × ``dtype`` and outputs
        ``out_width`` wide (None: ``hidden``); room after the returned outputs for a pass's own rows on every
        slot of a stacked expert (``W · pass_tokens``: the shared expert's outputs written in place)."""
        buffers = self._buffers
        width = hidden if out_width is None else out_width
        if buffers is None or buffers.dtype != dtype or buffers.hidden != hidden or buffers.out_width != width:
            if self.peer is None:
                raise ValueError("the kernel backend's expert-parallel layer needs a PeerExchange")
            device = self.slot_counts.device
            world = self.peer.world_size
            buffers = PeerBuffers.allocate(
                world, self.pass_tokens * top_k, hidden, dtype, device, world * self.pass_tokens, width
            )
            self._buffers = buffers
        return buffers

    def take_slot_counts(self) -> torch.Tensor:
        """The counts since the last take, zeroed in place (a captured graph keeps adding to this tensor)."""
        counts = self.slot_counts.clone()
        self.slot_counts.zero_()
        return counts


class ExpertParallelMoE(nn.Module):
    """Replaces one layer's ``MoE`` as the block's ``ffn``. ``moe`` keeps its router and shared expert; its
    ``w1``/``w2``/``w3`` become this rank's slots [S, I, D] / [S, D, I] (slot order), the rest dropped."""

    def __init__(self, moe: MoE, layer: int, parallel: ExpertParallel) -> None:
        super().__init__()
        self.moe = moe
        self.layer = layer
        self.parallel = parallel
        local = torch.tensor(parallel.slots[layer].local_experts, dtype=torch.long)
        for name in ("w1", "w2", "w3"):
            full = getattr(moe, name)
            setattr(moe, name, nn.Parameter(full.data[local.to(full.device)].clone(), requires_grad=False))

    moves_in_place = False  # a move hands it every slot's new tensors, which it takes as its own

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        """This rank's slots' (w1 [S, I, D], w3 [S, I, D], w2 [S, D, I]), slot order: what EPLB moves
        (services/worker/parallel/expert_moves.py)."""
        return self.moe.w1.data, self.moe.w3.data, self.moe.w2.data

    def put_expert_weights(self, weights: tuple[torch.Tensor, ...], changed: list[int]) -> None:
        """Takes a move's ``weights`` (``expert_weights``' form, the new layout's slot order) as the layer's own
        (a swap: no copy, so ``changed`` is not needed)."""
        for name, w in zip(("w1", "w3", "w2"), weights, strict=True):
            if w.is_cuda:  # made on the mover's stream, read on this one: freed only after this one's use
                w.record_stream(torch.cuda.current_stream(w.device))
            setattr(self.moe, name, nn.Parameter(w, requires_grad=False))

    def forward(
        self, x: torch.Tensor, counts: torch.Tensor | None = None, image: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [B, S, D] → [B, S, D]; as ``MoE.forward``."""
        moe, parallel = self.moe, self.parallel
        slots = parallel.slots[self.layer]
        shape = x.shape
        x = x.reshape(-1, shape[-1])  # [T, D]
        weights, experts = moe.route(x, None if image is None else image.reshape(-1))  # [T, k] each
        num_tokens, k = experts.shape
        if parallel.routes_nothing:
            pairs = torch.empty(0, dtype=torch.long, device=x.device)
        else:
            pairs = torch.arange(num_tokens * k, device=x.device)
            if counts is not None:
                counts += torch.bincount(experts.flatten(), minlength=counts.numel())
        shared = clamped_swiglu(F.linear(x, moe.shared_w1), F.linear(x, moe.shared_w3), moe.limit).to(x.dtype)
        physical = slots.physical(experts)[pairs]  # [P]
        dest = torch.div(physical, slots.slots_per_rank, rounding_mode="floor")
        order = torch.argsort(dest, stable=True)  # pairs grouped by destination rank
        sent = pairs[order]
        got = parallel.exchange.dispatch(
            x[sent // k], dest[order], (physical % slots.slots_per_rank)[order], weights.reshape(-1)[sent]
        )
        out_rows = self._experts(got.rows, got.slots, got.weights, x.dtype)
        back = parallel.exchange.combine(out_rows, got)  # [P, D]
        routed = torch.zeros(num_tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)  # [T·k, D]
        routed[sent] = back.float()
        routed = routed.view(num_tokens, k, -1)
        # The combine, in fp32 and one fixed order: the shared expert, then the routed ones in top-k order.
        out = F.linear(shared, moe.shared_w2).float()
        for j in range(k):
            out = out + routed[:, j]
        return out.to(x.dtype).reshape(shape)

    def _experts(
        self, rows: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """This rank's experts on the rows that arrived: [M, D] in ``dtype``, as ``MoE.forward`` computes
        each (row, expert); counts each arrival on its physical slot."""
        moe = self.moe
        out = torch.zeros(rows.shape[0], rows.shape[-1], dtype=dtype, device=rows.device)
        if rows.shape[0] == 0:
            return out
        self.parallel.slot_counts[self.layer] += torch.bincount(slots, minlength=self.parallel.slot_counts.shape[1])
        for s in slots.unique().tolist():
            (idx,) = torch.where(slots == s)
            xe = rows[idx]  # [t, D]
            act = clamped_swiglu(xe @ moe.w1[s].t(), xe @ moe.w3[s].t(), moe.limit)  # [t, I]
            act = (act * weights[idx, None]).to(dtype)
            out[idx] = act @ moe.w2[s].t()
        return out


def shard_experts(model: DeepseekV41, parallel: ExpertParallel) -> None:
    """Makes every layer's MoE expert-parallel in place: this rank keeps only its slots' weights."""
    for block in model.layers:
        if not isinstance(block.ffn, MoE):
            raise ValueError(
                f"layer {block.layer}'s ffn is {type(block.ffn).__name__}, not the model's MoE: "
                "expert parallelism runs on the torch MoE (kernel_backend None) so far"
            )
        block.ffn = ExpertParallelMoE(block.ffn, block.layer, parallel)
