"""The kernel backend's expert-parallel MoE layer: ``KernelMoE`` with its routed experts spread over ranks,
exchanged through fixed-capacity buffers, so a CUDA graph can capture a whole layer.

Per pass of at most ``pass_tokens`` tokens (one for a decode step), each rank:

1. routes its tokens with the kernel router (``KernelMoE``'s: the same choices and weights); then one launch
   (``send_layout``, kernels/ep_layout.py) adds the live picks to the layer's logical ``counts``, maps each pick
   to one physical slot (``ExpertSlots``' table), and packs each live pick's row, slot and weight into its peer's
   block of the send buffer (a pick's place in its block is its rank among the picks to that peer, in pick
   order), with each block's count; the blocks go out in one all-to-all (``PeerExchange.all_to_all``;
   services/worker/parallel/peer_buffers.py has the byte layout);
2. lays out what it received and its own tokens for the grouped GEMM in one launch (``received_layout``: its S
   local slots and the shared expert stacked as expert S, the rows past a block's count dropped, each slot's
   arrivals added to ``slot_counts``);
3. runs one masked grouped-GEMM pair (``kernels.moe_grouped_gemm``, gate/up + SwiGLU · route weight, then down;
   MXFP4 routed experts: ``kernels.moe_fp4``'s, the shared expert FP8 beside them, as ``Fp4Experts``) over
   those rows (received, then its own: the shared expert, weight 1); the received rows are gathered where they
   arrived (``PeerBuffers.gathered_rows``), and with MXFP4 experts the shared expert reads the own tokens
   where they are, so only the FP8 stack's single launch needs them copied after the received blocks;
4. returns each received row's bf16 output to its sender in the block it came in (a second all-to-all into the
   head of ``combined``, whose tail holds its own tokens' shared outputs), and sums every token's outputs with
   ``kernels.moe_combine`` in fp32, the shared expert first, then the picks in top-k order.

Without ``ep_layout`` in the kernel set (the torch references' set) both layouts run as torch ops
(services/worker/parallel/exchange_layout.py, the kernels' specification: the same bytes).

Each (row, expert) output is the grouped GEMM's for that row and expert alone (in the batch-invariant mode its
tiles and K order are fixed), and the sum runs in ``KernelMoE``'s order, so a token's output has
``KernelMoE``'s bits whichever rank holds its experts. Every shape is fixed by ``pass_tokens``, the world size
and the slots, and nothing is read back to the host: the layer is graph-safe on a group whose all-to-all a
graph captures (NCCL, or the virtual ranks' copies).

``ep_layer`` runs one layer for every rank of this process (one for a real rank, N for virtual ranks), so
both drive the same phases in the same order. A placeholder step (``ExpertParallel.routes_nothing``) routes
nothing and still makes every exchange. Eager steps longer than a pass run several; the group agrees on the
step's number of passes first (``ExpertParallel.agree_passes``).

Live EPLB (services/worker/parallel/live_layouts.py) writes moved experts into the same stacks in place
(``put_expert_weights``: the changed slots' codes and scales, FP8 or MXFP4) and the new slot map into
``ExpertSlots``' tensors in place: every buffer a captured graph reads keeps its address, so graphs replay the
new layout without a recapture.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.worker.kernel_model.fp8_linear import pad_last
from services.worker.kernel_model.moe import KernelMoE
from services.worker.parallel import exchange_layout
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.parallel.expert_slots import staged
from services.worker.parallel.peer_buffers import PeerBuffers


@dataclass
class _Pass:
    """One rank's tokens of one pass, between the phases."""

    x: torch.Tensor  # [T, D] the tokens
    live: torch.Tensor | None  # [T] bool: rows that route (live, and not a placeholder step); None: every row
    picks: torch.Tensor  # [T, k + 1] int64: each pick's row in the combine's rows (p·C + place; 0 when dead),
    # then the token's own row (W·C + t), where its shared expert's output goes


class ExpertParallelKernelMoE(nn.Module):
    """Replaces one layer's ``KernelMoE`` as the block's ``ffn``: its router and weights, its expert stacks cut
    to this rank's slots (slot order) with the shared expert last (FP8 stacks ``[S + 1, …]``; MXFP4 routed stacks
    ``[S, …]`` with the FP8 shared expert beside them)."""

    def __init__(self, moe: KernelMoE, layer: int, parallel: ExpertParallel) -> None:
        super().__init__()
        if moe.precision != "fp8":
            raise ValueError(
                "expert parallelism on the kernel backend runs its FP8 form (kernel_backend 'fp8'); this layer is "
                f"precision {moe.precision!r}"
            )
        self.moe = moe
        self.layer = layer
        self.parallel = parallel
        slots = parallel.slots[layer]
        local = torch.tensor(slots.local_experts, dtype=torch.long)
        if moe.fp4 is not None:  # MXFP4 routed stacks [S, ...], the shared expert FP8 beside them
            moe.fp4.keep(local)
        else:
            keep = torch.cat((local, torch.tensor([moe.num_experts]))).to(moe.w13.device)
            for name in ("w13", "w13_scale", "w2", "w2_scale"):  # [S + 1, ...]: this rank's slots, then the shared
                setattr(moe, name, getattr(moe, name).index_select(0, keep).contiguous())
        self.num_local = slots.slots_per_rank

    moves_in_place = True  # a move hands it only the changed slots, copied into its stacks (``put_expert_weights``)

    def expert_weights(self) -> tuple[torch.Tensor, ...]:
        """This rank's routed slots, slot order, as views of the stacks (the shared expert left out): FP8 (w13,
        w13_scale, w2, w2_scale) ``[S, …]`` e4m3 and fp32; MXFP4 the same names' uint8 codes and e8m0 bytes."""
        stacks = self.moe if self.moe.fp4 is None else self.moe.fp4
        return tuple(getattr(stacks, n)[: self.num_local] for n in ("w13", "w13_scale", "w2", "w2_scale"))

    def put_expert_weights(self, weights: tuple[torch.Tensor, ...], changed: list[int]) -> None:
        """Copies a move's ``weights`` (``expert_weights``' form, the ``changed`` slots only, in that order) into
        those slots of the stacks in place: the stacks keep their addresses (module docstring)."""
        if not changed:
            return
        mine = self.expert_weights()
        index = staged(torch.tensor(changed, dtype=torch.long), mine[0].device).to(mine[0].device, non_blocking=True)
        for dst, src in zip(mine, weights, strict=True):
            if src.shape != (len(changed), *dst.shape[1:]) or dst.dtype != src.dtype:
                raise ValueError(
                    f"moved experts {src.dtype} {list(src.shape)} for {len(changed)} slots of a stack of "
                    f"{dst.dtype} {list(dst.shape)}"
                )
            dst.view(torch.uint8).index_copy_(0, index, src.view(torch.uint8))
            if src.is_cuda:  # made on the mover's stream, read on this one: freed only after this one's use
                src.record_stream(torch.cuda.current_stream(src.device))

    def forward(
        self,
        x: torch.Tensor,
        counts: torch.Tensor | None = None,
        live: torch.Tensor | None = None,
        image: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As ``KernelMoE.forward``: x [B, S, D] → [B, S, D]."""
        return ep_layer([self], [x], [counts], [live], [image])[0]

    def dispatch(
        self,
        x: torch.Tensor,
        counts: torch.Tensor | None,
        live: torch.Tensor | None,
        image: torch.Tensor | None,
    ) -> _Pass:
        """Routes x [T, D] and packs its live picks into the send buffers (``send_layout``)."""
        moe, parallel = self.moe, self.parallel
        num_tokens, k = x.shape[0], moe.top_k
        buffers, slots = self.exchange_buffers(x.dtype), parallel.slots[self.layer]
        x = x.contiguous()
        vl = {} if image is None else {"bias_vl": moe.bias_vl, "image": image}
        weights, experts = moe.kernels.moe_router.moe_router(
            x, moe.gate_weight, moe.gate_bias, k, moe.route_scale, **vl
        )  # [T, k] each
        if parallel.routes_nothing:
            live = torch.zeros(num_tokens, dtype=torch.bool, device=x.device)
        elif live is not None:
            live = live.to(torch.bool)
        send = buffers.send
        picks = self._layouts().send_layout(
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
        return _Pass(x, live, picks)

    def _layouts(self):
        """The send and received layouts: the kernel set's (kernels/ep_layout.py), else their torch form."""
        return getattr(self.moe.kernels, "ep_layout", None) or exchange_layout

    def exchange_buffers(self, dtype: torch.dtype) -> PeerBuffers:
        """The group's buffers for this layer's rows (``dtype``) and its down products' width (D', padded)."""
        moe = self.moe
        width = moe.fp4.padded_hidden if moe.fp4 is not None else moe.w2.shape[1]
        return self.parallel.buffers_for(moe.hidden, dtype, moe.top_k, width)

    def run_experts(self, routed: _Pass) -> None:
        """The local slots on the received rows (outputs to ``send_back``) and the shared expert on this rank's
        own tokens (outputs to the tail of ``combined``)."""
        moe, buffers = self.moe, self.exchange_buffers(routed.x.dtype)
        world, capacity = buffers.world_size, buffers.capacity
        received = world * capacity
        num_tokens = routed.x.shape[0]
        recv = buffers.recv
        gathered = buffers.gathered_rows(recv)  # [W·block_rows, D]: the received rows in place
        fp4 = moe.fp4 is not None
        # MXFP4: the routed experts gather the received rows in place, and the shared expert reads the own tokens
        # where they are and writes each one's output to its row of ``combined`` (own token t at slot t: every own
        # row takes its slot, the dead ones' outputs never summed); FP8: one launch over every stacked expert, on
        # the received blocks followed by the own tokens, the shared outputs copied after.
        layout = self._layouts().received_layout(
            buffers.meta(recv),
            buffers.counts(recv),
            None if fp4 else routed.live,
            num_tokens,
            self.num_local,
            world * self.parallel.pass_tokens,
            buffers.block_rows,
            0 if fp4 else gathered.shape[0],
            self.parallel.slot_counts[self.layer],
            # MXFP4: the routed launch takes num_active − 1 experts, right only while the shared one counts, which
            # an empty pass lacks while its peers' rows arrive
            shared_active=fp4,
        )
        # The grouped GEMMs take their tiles and tuned configs from the shape of a layout's slot_of, read as
        # [tokens, picks per token] (KernelMoE's); the own tokens' picks [T, k + 1] show them this rank's step as
        # KernelMoE would see it (the same choices at world size 1), and they read no slot_of values.
        gemm_layout = dict(layout, slot_of=routed.picks)
        slot_of = layout["slot_of"][:, 0]
        if fp4:
            shared_out = buffers.combined[received:][None]  # [1, W·pass_tokens, D']: the layout's capacity
            y = moe.fp4.stacked(gathered, gemm_layout, shared_x=routed.x, shared_out=shared_out)
        else:
            y = self._fp8_experts(torch.cat((gathered, routed.x)), gemm_layout)
        y = y.view(-1, y.shape[-1])  # [(S + 1)·cap, D']
        torch.index_select(y, 0, slot_of[:received], out=buffers.send_back)
        if not fp4:
            torch.index_select(y, 0, slot_of[received:], out=buffers.combined[received : received + num_tokens])

    def _fp8_experts(self, rows: torch.Tensor, layout: dict[str, torch.Tensor]) -> torch.Tensor:
        """The FP8 stacks' down products of every (stacked expert, slot) of ``layout``: bf16 [S + 1, cap, D']."""
        moe = self.moe
        a = pad_last(rows, moe.w13.shape[-1]).contiguous()
        gemm, quant = moe.kernels.moe_grouped_gemm, moe.kernels.quant_fp8
        if a.shape[0] > quant.IN_GEMM_MAX_ROWS:
            a = quant.quantize_act(a)
        h = gemm.moe_grouped_gemm(
            a,
            moe.w13,
            moe.w13_scale,
            layout,
            gather=True,
            swiglu_limit=moe.limit,
            out_dtype=torch.float8_e4m3fn,
        )  # tiles and configs from the layout (``invariance.BLOCK_M`` in the batch-invariant mode)
        return gemm.moe_grouped_gemm(h, moe.w2, moe.w2_scale, layout, gather=False)

    def combine(self, routed: _Pass) -> torch.Tensor:
        """fp32 [T, D]: the shared expert's output, then the returned picks in top-k order (``kernels.moe_combine``
        over ``combined``: the returned rows, then the own tokens')."""
        buffers = self.exchange_buffers(routed.x.dtype)
        return self.moe.kernels.moe_grouped_gemm.moe_combine(
            buffers.combined[None], routed.picks, True, live=routed.live, width=self.moe.hidden
        )


def ep_layer(
    moes: list[ExpertParallelKernelMoE],
    xs: list[torch.Tensor],
    counts: list[torch.Tensor | None],
    lives: list[torch.Tensor | None],
    images: list[torch.Tensor | None],
) -> list[torch.Tensor]:
    """One layer on every rank of this process (``moes[i]`` rank i's, all of one exchange): outputs as
    ``KernelMoE.forward``'s. Every rank runs ``passes`` passes (the agreed number; 1 when none was agreed)."""
    parallel = moes[0].parallel
    exchange = parallel.peer
    pass_tokens = parallel.pass_tokens
    flat = [x.reshape(-1, x.shape[-1]) for x in xs]
    passes = max(m.parallel.passes for m in moes)
    for x in flat:
        if x.shape[0] > passes * pass_tokens:
            raise ValueError(
                f"{x.shape[0]} tokens need more than the {passes} passes of {pass_tokens} the group agreed "
                "(ExpertParallel.agree_passes before the step)"
            )
    outs: list[list[torch.Tensor]] = [[] for _ in moes]
    for p in range(passes):
        part = slice(p * pass_tokens, (p + 1) * pass_tokens)
        routed = [
            m.dispatch(
                x[part], c, None if v is None else v.reshape(-1)[part], None if g is None else g.reshape(-1)[part]
            )
            for m, x, c, v, g in zip(moes, flat, counts, lives, images, strict=True)
        ]
        buffers = [m.exchange_buffers(r.x.dtype) for m, r in zip(moes, routed, strict=True)]
        sent = [b.dispatched() for b in buffers]  # rows, meta and counts in one byte buffer per peer
        exchange.all_to_all([send for send, _ in sent], [recv for _, recv in sent])
        for m, r in zip(moes, routed, strict=True):
            m.run_experts(r)
        back = [b.returned() for b in buffers]
        exchange.all_to_all([send for send, _ in back], [recv for _, recv in back])
        for i, (m, r) in enumerate(zip(moes, routed, strict=True)):
            outs[i].append(m.combine(r))
    return [(torch.cat(o) if len(o) > 1 else o[0]).to(x.dtype).reshape(x.shape) for o, x in zip(outs, xs, strict=True)]


def shard_kernel_experts(model: nn.Module, parallel: ExpertParallel) -> None:
    """Makes every layer's ``KernelMoE`` (the model already converted) expert-parallel in place; the DSpark
    draft's MoE stays whole on each rank."""
    for block in model.layers:  # type: ignore[union-attr]
        if not isinstance(block.ffn, KernelMoE):
            raise ValueError(f"layer {block.layer}'s ffn is {type(block.ffn).__name__}, not the kernel backend's MoE")
        block.ffn = ExpertParallelKernelMoE(block.ffn, block.layer, parallel)


def unshard_kernel_experts(model: nn.Module) -> None:
    """Undoes ``shard_kernel_experts`` on a layer sharded over one rank (whose stacks hold every expert in order):
    the model's ``KernelMoE`` layers back, for an engine without expert parallelism on the same model (benchmarks)."""
    for block in model.layers:  # type: ignore[union-attr]
        if isinstance(block.ffn, ExpertParallelKernelMoE):
            if block.ffn.parallel.slots[block.layer].layout.num_gpus != 1:
                raise ValueError("only a layer sharded over one rank holds every expert")
            block.ffn = block.ffn.moe
