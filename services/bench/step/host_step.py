"""The host's share of a decode step: ``Engine.step`` at batch B with the device work stubbed out (a
runner that only builds the step's batch, a sampler that returns a token per row), so what is timed
is scheduling, sampling rows, the batch's host arrays and uploads, the worker's bookkeeping and the
update. On a GPU the device runs a step while the host does this for the next (async scheduling);
GPU-busy ≥ 97% needs this time well below the device's step time (the step floors: services/bench/step/floors.py)."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from kernels.sampler_output import SamplerOutput
from scheduler_rs import StepPlan
from services.bench.step.phases import StepPhases, describe
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.sampling_params import SamplingParams
from services.worker.batch.step_batch import PendingInputs, StepBatch
from services.worker.runners.reference_runner import RunnerOutput
from services.worker.sampling.sampler import SamplingRow
from services.worker.worker import Worker


class HostOnlyRunner:
    """Builds each step's batch (host arrays, on the CPU) and returns one-column logits."""

    backend = "torch"

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts

    def release(self, request_id: str) -> None:
        pass

    def execute(self, plan: StepPlan, all_rows: bool = False, *, pending: PendingInputs | None = None) -> RunnerOutput:
        batch = StepBatch.from_plan(plan, "cpu")
        if pending is not None:
            batch.fill_pending(plan, pending)
        n = batch.num_rows if all_rows else batch.sample_rows.numel()
        return RunnerOutput(
            torch.zeros(n, 1), torch.zeros(self.num_layers, self.num_experts, dtype=torch.long), batch.num_rows
        )


class HostOnlySampler:
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        n = len(rows)
        return SamplerOutput(
            token_ids=torch.full((n,), 7, dtype=torch.long),
            logprobs=torch.zeros(n),
            top_token_ids=torch.zeros(n, 0, dtype=torch.long),
            top_logprobs=torch.zeros(n, 0),
            errors=torch.zeros(n, dtype=torch.bool),
        )


def host_step_ms(
    batch: int,
    *,
    context: int = 4096,
    steps: int = 30,
    async_scheduling: bool = True,
    vocab_size: int = 129280,
    num_layers: int = 40,
    num_experts: int = 48,
    phases: StepPhases | None = None,
) -> float:
    """Median host ms per decode step of ``batch`` requests at ``context`` (prefill steps untimed);
    ``phases``, when given, also records the timed steps' split by phase."""
    config = EngineConfig(
        max_num_seqs=batch, max_model_len=context + steps + 64, block_size=128, async_scheduling=async_scheduling
    )
    engine = Engine(
        Worker(HostOnlyRunner(num_layers, num_experts), HostOnlySampler()),
        config,
        vocab_size=vocab_size,
        eos_token_id=1,
        compress_ratios=[4, 1],
        window_size=128,
    )
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=steps + 16, ignore_eos=True, seed=1)
    for i in range(batch):
        engine.add_request(f"host-{i}", [5] * context, params)
    while engine.last_plan is None or engine.last_plan.is_prefill or engine.last_plan.num_rows != batch:
        engine.step()
    times = []
    if phases is not None:
        phases.attach(engine)
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    finally:
        if phases is not None:
            phases.detach()
    return statistics.median(times) * 1e3


def host_section(batches, context: int) -> list[dict[str, Any]]:
    rows = []
    for batch in batches:
        split = {flag: StepPhases() for flag in (False, True)}
        ms = {
            flag: host_step_ms(batch, context=context, async_scheduling=flag, phases=split[flag])
            for flag in (False, True)
        }
        rows.append(
            {
                "section": "host",
                "batch": batch,
                "context": context,
                "sync_ms": ms[False],
                "async_ms": ms[True],
                "async_phases_ms": split[True].summary(),
            }
        )
        print(
            f"host    ctx {context:>6} batch {batch:>4}: {ms[False]:.2f} ms per decode step "
            f"(async {ms[True]:.2f} ms), device work stubbed; async by phase: {describe(split[True].summary())}"
        )
    return rows
