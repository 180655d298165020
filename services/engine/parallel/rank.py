"""One data-parallel rank: its process groups, its engine (scheduler, worker, caches) with the routed
experts sharded over the group, and the loop that steps it in lockstep with the other ranks.

Every rank steps the same number of times: before each step the group votes whether any rank has work
left, and a rank with nothing to do runs a placeholder step (its scheduler's empty plan, which the runner
turns into one fake row that routes to no expert). Inside a step every rank makes the same collectives
in the same order: the scheduler's votes at vote points, then four exchanges per MoE layer.
"""

from __future__ import annotations

import contextlib
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

import torch

from model.deepseek_v41.config import ModelConfig
from model.deepseek_v41.model import DeepseekV41
from services.engine.config import EngineConfig
from services.engine.device import CUDA_DEFAULTS
from services.engine.engine import Engine
from services.engine.model_source import ModelSource
from services.engine.outputs import RequestOutput
from services.engine.parallel.vote import HostVote
from services.engine.sampling_params import SamplingParams
from services.eplb.layout import Layout
from services.worker.build import build_worker
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.parallel.expert_moves import apply_layouts
from services.worker.parallel.groups import RankGroups, close_rank_groups, init_rank_groups
from services.worker.parallel.live_layouts import LayoutUpdate, LiveLayouts
from services.worker.parallel.rank_experts import shard_over_group

# Seconds between a waiting rank's checks that its driver process is still there.
PARENT_POLL_S = 1.0
# Seconds between idle boundary votes while live EPLB moves finish between calls.
SETTLE_POLL_S = 0.01


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs, the same for every rank (picklable: it crosses a spawn)."""

    config: EngineConfig  # the engine's knobs; data_parallel_size is the group's size
    load: Callable[[str], ModelSource]  # device → the model (each rank loads its own copy)
    init_method: str  # the group's rendezvous, "file://…", "tcp://host:port" or "env://" (a launcher's)
    device: str  # "cpu"; "cuda" (rank r runs on cuda:r, every rank on this host); or "cuda:N" (one served rank
    # of a group that may span hosts, on its own GPU)
    num_threads: int | None = None  # torch CPU threads per rank; None = OMP_NUM_THREADS, else the cores over the ranks
    # The kernel backend's kernel set as a context the rank process runs inside (a module-level callable →
    # a context manager yielding the ``KernelSet``); None: the compiled set. Interpreted copies run the kernel
    # backend's ranks on a CPU (kernels/interpret.py).
    kernels: Callable[[], contextlib.AbstractContextManager[KernelSet]] | None = None

    def rank_device(self, rank: int) -> str:
        return f"cuda:{rank}" if self.device == "cuda" else self.device


@dataclass
class RankEngine:
    """A built rank: its groups, vote, expert parallelism and engine."""

    rank: int
    groups: RankGroups
    vote: HostVote
    parallel: ExpertParallel
    engine: Engine
    model: DeepseekV41  # this rank's model, its MoE layers sharded
    source: ModelSource  # what the rank loaded: config and tokenizer beside ``model``
    live: LiveLayouts  # EPLB layouts applied live (its boundary is the work-left vote)


def rank_engine_args(engine_args: dict[str, object], device: str) -> dict[str, object]:
    """``engine_args`` with a rank's defaults where not given, as one process on ``device`` has them
    (services/engine/device.py): on CUDA the FP8 kernel backend with MXFP4 experts (the expert-parallel kernel
    layer), CUDA graphs for decode (off with ``enforce_eager`` or drafts) and async scheduling (off with drafts);
    on the CPU the torch MoE, eager, synchronous."""
    speculative = bool(engine_args.get("num_speculative_tokens"))
    if not str(device).startswith("cuda"):
        return {"kernel_backend": None, "cuda_graphs": False, "async_scheduling": False, **engine_args}
    out = {**CUDA_DEFAULTS, "async_scheduling": not speculative, **engine_args}
    out.setdefault(
        "cuda_graphs", out["kernel_backend"] is not None and not out.get("enforce_eager", False) and not speculative
    )
    return out


def apply_expert_layouts(rank: RankEngine, layouts: list[Layout]) -> int:
    """Between steps, on every rank at once (``Ranks.call``): move to EPLB ``layouts`` (one per layer) over
    the moves group; the next step routes by them. Returns the experts this rank received from peers."""
    rank.live.resync()  # refuses while live versions are on their way (before anything moves)
    received = apply_layouts(rank.model, rank.parallel, layouts, rank.groups.moves)
    rank.live.resync()
    return received


def eplb_switches(rank: RankEngine) -> tuple[list[tuple[int, int]], int]:
    """On every rank at once (``Ranks.call``): the (version, boundary) of each live EPLB switch so far and the
    boundaries seen (the same on every rank)."""
    return list(rank.live.switches), rank.live.num_boundaries


def settle_live_layouts(rank: RankEngine, timeout_s: float) -> int:
    """Between calls, on every rank at once (``Ranks.call``): idle boundary votes until every version the
    group has received is in force; returns the version in force. Every rank leaves at the same vote (the
    condition reads only agreed values)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rank.vote.any_rank(False)
        if rank.live.settled:
            return rank.live.version
        if time.monotonic() > deadline:  # the group's agreed values: every rank raises at the same vote
            raise TimeoutError(
                f"EPLB version {rank.live.agreed.received} not in force within {timeout_s} s "
                f"(in force: {rank.live.version}; mover: {rank.live.error or 'working'})"
            )
        time.sleep(SETTLE_POLL_S)


def build_rank(
    rank: int, spec: RankSpec, groups: RankGroups | None = None, kernels: KernelSet | None = None
) -> RankEngine:
    """Joins the group (unless ``groups``, already joined, is given) and builds this rank's engine; every
    rank of the group calls it. ``kernels``: the kernel backend's set (None: the compiled one). With
    speculative decoding the worker verifies and proposes drafts: the verified rows are rows of the step like
    any other (they cross the exchange), and the DSpark draft, whose MoE is not sharded, runs on this rank
    alone."""
    world = spec.config.data_parallel_size
    device = spec.rank_device(rank)
    if spec.device.startswith("cuda:"):
        index = int(spec.device.split(":")[1])
        if index >= torch.cuda.device_count():
            raise ValueError(f"rank {rank} asked for {spec.device}; {torch.cuda.device_count()} GPUs are visible")
        torch.cuda.set_device(device)
    elif device.startswith("cuda"):
        if torch.cuda.device_count() < world:
            raise ValueError(
                f"{world} ranks need {world} GPUs (NCCL puts one rank on a GPU); "
                f"{torch.cuda.device_count()} are visible"
            )
        torch.cuda.set_device(device)
    threads = spec.num_threads or int(os.environ.get("OMP_NUM_THREADS", 0)) or (os.cpu_count() or 1) // world
    torch.set_num_threads(max(1, threads))
    if groups is None:
        groups = init_rank_groups(rank, world, spec.init_method, device, spec.config.rank_timeout_s)
    source = spec.load(device)
    model, cfg = source.model, source.config
    if model is None:
        raise ValueError("a rank needs the model's weights")
    config = spec.config.replace(device=device)
    parallel = shard_over_group(model, groups, spec.config.num_redundant_experts, device, config.worker_config())
    # The draft (with drafts) as for one process: its batch-invariant mode on the CPU only (services/worker/build.py).
    worker = build_worker(model, config.worker_config(), expert_parallel=parallel, kernels=kernels)
    vote = HostVote(groups.vote)
    engine = group_engine(worker, config, cfg, vote)
    vote.live = LiveLayouts([block.ffn for block in model.layers], parallel, groups.moves)
    return RankEngine(rank, groups, vote, parallel, engine, model, source, vote.live)


def group_engine(worker, config: EngineConfig, cfg: ModelConfig, vote: HostVote) -> Engine:
    """A rank's engine around its ``worker`` (in-process, or a worker process's `RemoteWorker`), voting
    with the group through ``vote``."""
    kv_ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    return Engine(
        worker,
        config,
        vocab_size=cfg.vocab_size,
        eos_token_id=cfg.eos_token_id,
        compress_ratios=kv_ratios or [1],
        window_size=cfg.sliding_window,
        vote=vote,
    )


def run_to_completion(
    rank: RankEngine,
    requests: list[tuple[str, list[int], SamplingParams]],
    updates_at: dict[int, list[LayoutUpdate]] | None = None,
    on_step: Callable[[], None] | None = None,
) -> list[RequestOutput]:
    """Queues this rank's share (possibly none) and steps in lockstep until no rank has work left;
    returns this rank's finished outputs. The last vote found no rank with work, so the group is marked
    idle: the next call's first step votes at an ANY point and a lone prompt prefills at once.
    ``updates_at``: k → live EPLB updates this rank receives just before the call's k-th boundary (the
    work-left vote before step k); those due after the last are received at the end, for the next boundary.
    ``on_step``: called after each step (e.g. to take that step's slot counts)."""
    engine = rank.engine
    for request_id, ids, params in requests:
        engine.add_request(request_id, ids, params)
    finished: dict[str, RequestOutput] = {}
    pending = sorted((updates_at or {}).items())
    boundary = 0
    while True:
        while pending and pending[0][0] <= boundary:
            for update in pending.pop(0)[1]:
                rank.live.receive(update)
        boundary += 1
        if not rank.vote.any_rank(engine.has_unfinished()):
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if on_step is not None:
            on_step()
    for _, updates in pending:  # due after the group's last step: taken at the next boundary
        for update in updates:
            rank.live.receive(update)
    engine.scheduler.mark_group_idle()
    return list(finished.values())


def rank_main(rank: int, spec: RankSpec, commands, results) -> None:
    """A rank process: builds the rank, reports ("ready", rank), then serves commands until None:
    ("generate", (requests, updates_at)) → ("done", rank, outputs);
    ("call", (fn, args)) → ("done", rank, fn(rank, *args)) for a module-level ``fn`` that every rank runs in
    lockstep (benchmarks). Any failure is reported as ("error", rank, text) and ends the process with code 1."""
    parent = os.getppid()
    try:
        with contextlib.ExitStack() as stack:
            kernels = None if spec.kernels is None else stack.enter_context(spec.kernels())
            serve_rank(build_rank(rank, spec, kernels=kernels), parent, commands, results)
    except BaseException:  # noqa: BLE001 - reported to the driver, which stops the group
        results.put(("error", rank, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    close_rank_groups()


def serve_rank(built: RankEngine, parent: int, commands, results) -> None:
    """``rank_main``'s command loop over a built rank."""
    rank = built.rank
    results.put(("ready", rank, None))
    while True:
        try:
            command = commands.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the driver is gone (even killed): no rank outlives it
                break
            continue
        if command is None:
            built.live.close()
            break
        kind, payload = command
        if kind == "generate":
            results.put(("done", rank, run_to_completion(built, *payload)))
        elif kind == "call":
            fn, args = payload
            results.put(("done", rank, fn(built, *args)))
        else:
            raise ValueError(f"unknown rank command {kind!r}")
