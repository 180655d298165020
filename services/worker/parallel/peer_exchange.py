"""The fixed-shape all-to-all of the kernel backend's expert exchange, behind one small interface.

Every tensor exchanged is ``[W, C, ...]`` (W ranks, C rows per peer): block ``p`` of a rank's send tensor
goes to rank ``p``, and block ``p`` of its receive tensor comes from rank ``p``. Shapes never depend on the
step's routing, and the counts of valid rows travel as tensors like the rows, so nothing is read back to
the host and a CUDA graph can capture the exchange (services/worker/parallel/ep_kernel_moe.py).

- ``GroupPeerExchange``: one rank per process, ``all_to_all_single`` with equal splits on a
  torch.distributed group (NCCL on a GPU, which graphs capture; gloo on the CPU, whose 2-byte floats travel
  as their bytes, so nothing is rounded on the way).
- ``VirtualPeerExchange``: N ranks inside one process (the one-GPU test seam): the same blocks moved by
  device copies, also captured by graphs.

``all_to_all(sends, recvs)`` takes one send and one receive tensor per rank of this process, in rank order:
one of each for a group, N for the virtual ranks.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch
import torch.distributed as dist

# Dtypes gloo cannot carry travel as their bytes (gloo has no int16 or bf16 all-to-all).
_CARRIER = {torch.bfloat16: torch.uint8, torch.float16: torch.uint8}


class PeerExchange(Protocol):
    world_size: int  # ranks exchanging (every tensor's first dimension)
    seconds: float  # seconds spent inside all_to_all, cumulative (bench step --dp takes differences)

    def all_to_all(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> None:
        """``recvs[i][p] = sends of rank p [i]`` for every rank i of this process and every rank p."""
        ...


def _check(sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], local: int, world: int) -> None:
    if len(sends) != local or len(recvs) != local:
        raise ValueError(f"{local} local ranks exchange one send and one receive tensor each")
    for send, recv in zip(sends, recvs, strict=True):
        if send.shape != recv.shape or send.dtype != recv.dtype or send.shape[0] != world:
            raise ValueError(
                f"send {send.dtype} {tuple(send.shape)} and receive {recv.dtype} {tuple(recv.shape)} must be "
                f"one shape [{world}, C, ...]"
            )


class GroupPeerExchange:
    """This process's rank of a torch.distributed group."""

    def __init__(self, group: dist.ProcessGroup, world_size: int) -> None:
        self.group = group
        self.world_size = world_size
        self.seconds = 0.0
        self.bytes_as_bytes = dist.get_backend(group) == "gloo"

    def all_to_all(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> None:
        _check(sends, recvs, 1, self.world_size)
        start = time.perf_counter()
        send, recv = sends[0], recvs[0]
        carrier = _CARRIER.get(send.dtype) if self.bytes_as_bytes else None
        if carrier is not None:
            send, recv = send.view(carrier), recv.view(carrier)
        if not recv.is_contiguous():
            raise ValueError("the receive tensor must be dense")
        dist.all_to_all_single(recv, send.contiguous(), group=self.group)
        self.seconds += time.perf_counter() - start


class VirtualPeerExchange:
    """``world_size`` ranks in this process: each block copied from its sender's tensor to its receiver's."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.seconds = 0.0

    def all_to_all(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor]) -> None:
        _check(sends, recvs, self.world_size, self.world_size)
        start = time.perf_counter()
        for i, recv in enumerate(recvs):
            for p, send in enumerate(sends):
                recv[p].copy_(send[i])
        self.seconds += time.perf_counter() - start
