"""Where a served rank sits in a group that may span hosts: its rank, the group's size, its device on its host.

A group on one host is started by `shinkai up --dp N` or `shinkai serve --dp N`, which give each rank
``--dp N --dp-rank R --dp-rendezvous tcp://…``. A group over several hosts is started by a launcher on each
host, one engine process per device: ``torchrun --nnodes M --node-rank K --nproc-per-node P --master-addr A
--master-port B -m services.entrypoints.engine --dp-rendezvous env:// …`` (docs/parallelism.md). torchrun
numbers the ranks host-major (rank = K · P + local rank) and tells each process where it sits through the
environment; `from_launcher` reads it. The group then meets at ``env://``: torchrun's own store on the
master host, so no second port is needed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

# The variables torchrun sets for each process it starts (torch.distributed.run).
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class RankPlace:
    rank: int  # this rank in the group, 0 … world_size − 1 (host-major)
    world_size: int  # ranks in the group, over every host
    local_rank: int  # this rank's index on its host: its GPU, and its offset from the host's base ports
    rendezvous: str  # where the group meets: "tcp://host:port" or "env://"

    def device(self, device: str) -> str:
        """This rank's device for the ``--device`` given to every rank: ``cuda`` becomes ``cuda:<local rank>``
        (one process per GPU of its host); ``cpu`` and an explicit ``cuda:N`` stay."""
        return f"cuda:{self.local_rank}" if device == "cuda" else device

    def port(self, base: int | None) -> int | None:
        """This rank's port from its host's ``base`` (the host's ranks take base, base + 1, …); 0 (any free
        port) and None stay."""
        return base + self.local_rank if base else base


def from_launcher(environ: Mapping[str, str]) -> RankPlace:
    """The place torchrun's environment gives this process; ValueError naming what is missing or wrong."""
    missing = [name for name in LAUNCHER_ENV if not environ.get(name)]
    if missing:
        raise ValueError(
            f"--dp-rendezvous env:// needs a launcher's environment (torchrun sets it): {', '.join(missing)} unset"
        )
    try:
        rank, world, local = (int(environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    except ValueError as err:
        raise ValueError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {err}") from None
    if world < 2:
        raise ValueError(f"a served rank belongs to a group of at least 2 ranks, not WORLD_SIZE={world}")
    if not 0 <= rank < world or not 0 <= local <= rank:
        raise ValueError(f"RANK={rank}, LOCAL_RANK={local} do not fit a group of WORLD_SIZE={world}")
    return RankPlace(rank, world, local, "env://")
