"""The MoE token exchange of one rank: dispatch (rows to the ranks that hold their experts) and combine
(the experts' outputs back), each an ``all_to_all_single`` with split sizes on the exchange group.

Per MoE layer and step every rank makes the same four calls in the same order, whatever it holds (a
placeholder step sends and receives nothing but still calls): the split sizes, the rows, the rows'
(slot, weight) pairs, and the outputs back. Rows travel as their raw bits (bf16 as bytes), so nothing is
rounded on the way. On a CUDA group (NCCL) the split sizes are read back to the host once per layer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Dtypes gloo cannot carry travel as their bytes (gloo has no int16 or bf16 all-to-all).
_CARRIER = {torch.bfloat16: torch.uint8, torch.float16: torch.uint8}


@dataclass
class Dispatched:
    """What one rank received for its experts in one layer, and the split sizes to send it back."""

    rows: torch.Tensor  # [M, D] hidden rows, the senders' dtype
    slots: torch.Tensor  # [M] long, this rank's local slot for each row
    weights: torch.Tensor  # [M] fp32, each row's route weight
    num_sent: list[int]  # rows this rank sent to each rank (its combine receives these back)
    num_received: list[int]  # rows this rank received from each rank (its combine sends these back)


def all_to_all_rows(
    group: dist.ProcessGroup, send: torch.Tensor, num_sent: list[int], num_received: list[int]
) -> torch.Tensor:
    """``send`` [N, ...] whose first ``num_sent[r]`` rows (in rank order) go to rank r → the rows received,
    ``num_received[r]`` from rank r, in rank order; bit for bit (2-byte floats travel as bytes)."""
    carrier = _CARRIER.get(send.dtype)
    wire = send.contiguous() if carrier is None else send.contiguous().view(carrier)
    out = wire.new_empty((sum(num_received), *wire.shape[1:]))
    dist.all_to_all_single(out, wire, output_split_sizes=num_received, input_split_sizes=num_sent, group=group)
    return out if carrier is None else out.view(send.dtype)


class Exchange:
    def __init__(self, group: dist.ProcessGroup, world_size: int) -> None:
        self.group = group
        self.world_size = world_size
        # Seconds spent inside this rank's exchange calls, cumulative (bench step --dp takes differences).
        self.seconds = 0.0

    def dispatch(
        self, rows: torch.Tensor, dest: torch.Tensor, slots: torch.Tensor, weights: torch.Tensor
    ) -> Dispatched:
        """``rows`` [P, D], ``dest`` [P] (ranks, ascending: rows grouped by destination), ``slots`` [P] local
        slots on the destination, ``weights`` [P] fp32."""
        start = time.perf_counter()
        send = torch.bincount(dest, minlength=self.world_size)  # [W]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)
        num_sent, num_received = send.tolist(), recv.tolist()
        # (slot, weight bits) as one int64 pair per row.
        meta = torch.stack([slots.long(), weights.float().contiguous().view(torch.int32).long()], dim=1)  # [P, 2]
        got_rows = all_to_all_rows(self.group, rows, num_sent, num_received)
        got_meta = all_to_all_rows(self.group, meta, num_sent, num_received)
        got_weights = got_meta[:, 1].to(torch.int32).view(torch.float32)
        self.seconds += time.perf_counter() - start
        return Dispatched(got_rows, got_meta[:, 0], got_weights, num_sent, num_received)

    def combine(self, outputs: torch.Tensor, dispatched: Dispatched) -> torch.Tensor:
        """The experts' outputs [M, D] for ``dispatched``'s rows → [P, D], in the order this rank sent."""
        start = time.perf_counter()
        back = all_to_all_rows(self.group, outputs, dispatched.num_received, dispatched.num_sent)
        self.seconds += time.perf_counter() - start
        return back
