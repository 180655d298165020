"""One data-parallel rank as a served engine (`python -m services.entrypoints.engine --dp N --dp-rank R`).

Each rank of a served group is its own engine endpoint: its own gRPC port, registered with the gateway like
any replica, so the gateway's router spreads requests over the ranks by load (NATS load reports) and its
request ids, unique across the gateway, stay unique across the ranks. The ranks meet at a ``tcp://``
rendezvous (rank 0 hosts it) and then step in lockstep inside `EngineService`'s step loop:

- before each step every rank votes whether any rank has work (`HostVote.any_rank`); if one has, every rank
  steps, the idle ones with placeholder steps, so the exchanges and the scheduler's votes line up;
- when no rank has work, nobody steps: each rank waits for a request (or ``idle_wait_s``), then votes again,
  so an idle group costs one small all-reduce per rank per ``idle_wait_s``, not a spinning core;
- a rank stops only when every rank is stopping and none has work (a second, ALL vote while idle), so
  `shinkai down`'s SIGTERM to the whole group drains every rank before any leaves.

With ``--worker`` each rank's worker is a process of its own
(`python -m services.entrypoints.worker --dp N --dp-rank R`): the engines meet at their rendezvous and vote; the workers
meet at theirs and exchange tokens, each holding its share of the experts. A worker that loses a peer fails its step, so
its engine's step fails too.

A lost rank breaks the group for good: a survivor's next collective fails (at once on a closed connection,
else within ``rank_timeout_s``), its live requests end with "error", it leaves the group so the others fail
at once too, and it reports NOT_SERVING until it is stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.model_source import ModelSource, load_model
from services.engine.parallel.rank import RankEngine, RankSpec, build_rank, group_engine, rank_engine_args
from services.engine.parallel.vote import HostVote
from services.engine.remote.remote_worker import RemoteWorker
from services.worker.parallel.groups import init_rank_groups


@dataclass
class RankLLM:
    """A served rank in the shape `ServedEngine` reads from an `LLM`: its engine, config and model source."""

    engine: Engine  # this rank's engine, voting with the group
    config: EngineConfig  # this rank's (device resolved); data_parallel_size is the group's size
    source: ModelSource  # this rank's model (its MoE layers sharded; no weights with a worker process), config
    # and tokenizer
    rank: RankEngine | None = None  # the in-process rank (its expert slots and live EPLB layouts); None with a
    # worker process, which holds the weights

    @property
    def tokenizer(self):
        return self.source.tokenizer


def rank_config(engine_args: dict[str, object], remote: bool) -> EngineConfig:
    """A rank's configuration with a rank's defaults (`rank_engine_args`); async scheduling always off with a
    worker process (its protocol does not carry the previous step's sampled tokens)."""
    device = "cpu" if remote else str(engine_args.get("device") or "cpu")
    config = EngineConfig(**rank_engine_args(engine_args, device))  # type: ignore[arg-type]
    return config.replace(async_scheduling=False) if remote else config


def start_rank(
    model: str, rank: int, rendezvous: str, engine_args: dict[str, object], worker: RemoteWorker | None = None
) -> RankLLM:
    """Joins the group at ``rendezvous`` ("tcp://host:port", rank 0 listens there; or "env://", a launcher's
    store, services/engine/parallel/rank_place.py) as ``rank`` and builds
    this rank's engine; returns once every rank of the group has joined.

    ``worker``: this rank's worker process (``python -m services.entrypoints.worker --dp N --dp-rank R``), which holds
    the sharded weights and joins the workers' own group for the token exchange: the engines' group here
    carries only the votes ("the engine votes and its worker exchanges"), so this process needs no device
    and loads no weights."""
    config = rank_config(engine_args, worker is not None)
    world = config.data_parallel_size
    if world < 2:
        raise ValueError(f"a served rank belongs to a group of at least 2 ranks, not {world}")
    if not 0 <= rank < world:
        raise ValueError(f"--dp-rank {rank} is outside a group of {world} ranks")
    if not rendezvous.startswith(("tcp://", "env://")):
        raise ValueError(
            f"a served group meets at a tcp://host:port rendezvous (or env://, a launcher's), not {rendezvous!r}"
        )
    if worker is not None:
        source = load_model(model, config.model_seed, load_format=config.load_format, weights=False)
        # The engines' group: its vote group is the one this process uses (its exchange and moves groups,
        # gloo on the host, stay idle: the workers exchange among themselves).
        groups = init_rank_groups(rank, world, rendezvous, "cpu", config.rank_timeout_s)
        return RankLLM(group_engine(worker, config, source.config, HostVote(groups.vote)), config, source)
    device = str(config.device or "cpu")
    if rendezvous.startswith("tcp://"):  # a group on one host: rank r on cuda:r
        device = "cuda" if device.startswith("cuda") else "cpu"
    # else a launcher's rank, on any host: its own GPU, cuda:<local rank> (services/engine/parallel/rank_place.py)
    load = partial(
        load_model,
        model,
        config.model_seed,
        load_format=config.load_format,
        precision=config.kernel_backend,  # on CUDA the kernel form, as one process loads it
        expert_format=config.expert_format,
    )
    built = build_rank(rank, RankSpec(config, load, rendezvous, device))
    return RankLLM(built.engine, built.engine.config, built.source, built)
