"""The one place a `Worker` is assembled: its runner and, with drafts, its speculator.

Every process and API that runs a worker in-process (``LLM``, the worker process, a data-parallel rank,
the speculative benchmark) calls ``build_worker`` with the worker's share of the engine configuration
(``WorkerConfig``). The runner is:

- with ``cuda_graphs``: the cached runner on the kernel backend inside ``DecodeStepGraphs``, every decode
  size the scheduler can ask for captured here, before the first request;
- otherwise the cached ``ModelRunner`` (``expert_parallel``: a rank's share of the routed experts), or the
  full-recompute ``ReferenceRunner`` where the cached runner cannot be imported.

With ``num_speculative_tokens`` the worker gets a ``Speculator``; with ``cuda_graphs`` its proposal and verify
graphs of every bucket are captured here too, so no live step captures.
"""

from __future__ import annotations

import json
import logging
import time

from model.deepseek_v41.model import DeepseekV41
from services.worker import startup
from services.worker.config import WorkerConfig
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.spec.forced_acceptance import ForcedAcceptance
from services.worker.spec.speculator import Speculator
from services.worker.worker import Runner, Worker

log = logging.getLogger("shinkai.worker.build")


def build_runner(
    model: DeepseekV41,
    config: WorkerConfig,
    expert_parallel: ExpertParallel | None = None,
    kernels: KernelSet | None = None,
) -> Runner:
    """The runner ``build_worker`` uses when none is given (see the module docstring); ``kernels``: the kernel
    backend's set (None: the compiled one; interpreted copies run it on a CPU, kernels/interpret.py)."""
    nextn = config.num_speculative_tokens
    try:
        from services.worker.runners.model_runner import ModelRunner
    except ImportError:
        from services.worker.runners.reference_runner import ReferenceRunner

        if config.cuda_graphs or expert_parallel is not None:
            raise
        return ReferenceRunner(model)
    if config.cuda_graphs:  # checked before the runner converts the model in place
        device = model.embed.weight.device
        if device.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs the model on a CUDA device, but it is on {device}: load it "
                "onto the GPU and pass it as LLM(source=...), or leave cuda_graphs off"
            )
    cached = ModelRunner(
        model, config, nextn=nextn, with_taps=nextn > 0, expert_parallel=expert_parallel, kernels=kernels
    )
    if not config.cuda_graphs:
        return cached
    from scheduler_rs import graph_sizes
    from services.worker.runners.decode_step_graphs import DecodeStepGraphs

    runner = DecodeStepGraphs(cached, config, use_graphs=True, attention="triton")
    # Every size the scheduler can ask for, now: a capture inside a live step (seconds at v41 width) would
    # stall the requests in it. The sizes are the scheduler's own rule, which counts rows (max_num_seqs ×
    # (1 + nextn) at most: verify steps replay graphs too).
    capture_each(runner, graph_sizes(config.max_num_seqs * (1 + nextn)))
    return runner


def capture_each(runner, sizes: list[int]) -> dict[int, float]:
    """``runner.capture`` one size at a time, largest first (``DecodeStepGraphs.capture``'s order: the graphs share
    one memory pool, which the largest sizes first, so the smaller ones reuse its memory), each timed to the
    device's completion and reported as a step of the "capturing" phase; returns the seconds each size took
    (logged as one JSON line too). A size's time is mostly the Triton compiles of its kernel variants on the
    warm-up runs, which a warm compile cache skips."""
    import torch

    seconds: dict[int, float] = {}
    ordered = sorted(sizes, reverse=True)
    with startup.phase("capturing", total=len(ordered)) as step:
        for size in ordered:
            t0 = time.perf_counter()
            runner.capture([size])
            if torch.cuda.is_initialized():  # the warm-up runs' work, queued on a side stream, counted here
                torch.cuda.synchronize()
            seconds[size] = round(time.perf_counter() - t0, 3)
            step.advance(f"{size} rows")
    log.info("capture seconds per graph size %s", json.dumps({"capture_s": seconds}))
    return seconds


def build_worker(
    model: DeepseekV41,
    config: WorkerConfig,
    *,
    runner: Runner | None = None,
    expert_parallel: ExpertParallel | None = None,
    kernels: KernelSet | None = None,
    forced_acceptance: ForcedAcceptance | None = None,
    static_proposal: bool | None = None,
    greedy_only: bool = False,
) -> Worker:
    """A worker on ``model``: ``runner`` (default: ``build_runner``'s) and, with drafts, a speculator.
    ``forced_acceptance`` and ``static_proposal`` are the speculator's (the benchmark's switches);
    ``greedy_only`` captures only the all-greedy draft buckets."""
    runner = runner if runner is not None else build_runner(model, config, expert_parallel, kernels)
    if not config.num_speculative_tokens:
        return Worker(runner)
    # The draft's batch-invariant maths is the CPU torch mode (model/batch_invariant.py); on a GPU the draft runs
    # plain torch (greedy and deterministic-mode tokens do not depend on the draft's rounding).
    on_cpu = model.embed.weight.device.type == "cpu"
    speculator = Speculator(
        model,
        config.num_speculative_tokens,
        config.spec_sampling,
        batch_invariant=config.batch_invariant and on_cpu,
        forced_acceptance=forced_acceptance,
        cuda_graphs=config.cuda_graphs,
        static_proposal=static_proposal,
    )
    if config.cuda_graphs or static_proposal:  # every bucket's draft and verify graphs now
        with startup.phase("capturing"):
            speculator.capture_graphs(runner.cache, config.max_num_seqs, greedy_only=greedy_only)  # type: ignore[attr-defined]
    return Worker(runner, speculator=speculator)
