"""One rank's process groups: each kind of traffic on its own group, so none can block another.

- ``vote``: the engines' step votes and the "any work left" vote, always gloo on the host, so a vote
  never waits on the device;
- ``exchange``: the workers' token exchange (MoE dispatch and combine): NCCL when the rank runs on a
  GPU, gloo on the CPU;
- ``moves``: EPLB weight moves, apart from the exchange so a move never interleaves with a layer's
  all-to-all.

Every collective on them fails after ``timeout_s`` when a peer is gone (gloo also fails at once on a
closed connection), so a lost rank is an error, never a hang.

The rendezvous is ``file://`` (ranks of one host, offline), ``tcp://host:port`` (rank 0 listens there) or
``env://`` (a launcher's: ``torchrun`` sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE and may host the
store itself), so the ranks of a group may sit on several hosts.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

import torch.distributed as dist

LOOPBACK_HOSTS = ("localhost", "::1")  # besides 127.0.0.0/8


@dataclass(frozen=True)
class RankGroups:
    rank: int  # this rank, 0 … world_size − 1
    world_size: int  # data-parallel ranks = expert-parallel ranks
    vote: dist.ProcessGroup  # gloo, host: the NORMAL engine's votes
    exchange: dist.ProcessGroup  # gloo (CPU) or NCCL (CUDA): the MoE token exchange
    moves: dist.ProcessGroup  # same backend as exchange: EPLB weight moves
    timeout_s: float  # every collective's limit before it fails


def exchange_backend(device: str) -> str:
    """NCCL for a CUDA rank, gloo for a CPU one."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_rank_groups(rank: int, world_size: int, init_method: str, device: str, timeout_s: float) -> RankGroups:
    """Joins the group at ``init_method`` (a ``file://`` or ``tcp://`` rendezvous) and makes the three
    groups. Every rank calls it with the same arguments but its own ``rank``."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    if is_loopback(init_method, os.environ):
        # Ranks of one host talk over loopback unless told otherwise (a container's hostname may not resolve);
        # across hosts gloo takes the interface of this host's name, or GLOO_SOCKET_IFNAME when set.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
    backend = exchange_backend(device)
    vote = dist.new_group(backend="gloo", timeout=timeout)
    exchange = dist.new_group(backend=backend, timeout=timeout)
    moves = dist.new_group(backend=backend, timeout=timeout)
    return RankGroups(rank, world_size, vote, exchange, moves, timeout_s)


def is_loopback(init_method: str, environ) -> bool:
    """Whether every rank of the group meets on this host: a ``file://`` rendezvous, or a loopback address
    (``env://`` reads it from MASTER_ADDR)."""
    if init_method.startswith("file://"):
        return True
    host = environ.get("MASTER_ADDR", "") if init_method.startswith("env://") else urlsplit(init_method).hostname or ""
    return host in LOOPBACK_HOSTS or host.startswith("127.")


def close_rank_groups() -> None:
    """Leaves the group (each rank, once, at the end of its process)."""
    if dist.is_initialized():
        dist.destroy_process_group()
