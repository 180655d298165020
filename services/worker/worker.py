"""The worker: runs a StepPlan through a model runner and the sampler, and returns a StepResult."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from kernels.device import upload
from kernels.sampler_output import SamplerOutput
from scheduler_rs import StepPlan, StepResult
from services.worker.batch.step_batch import PendingInputs, pending_shifts
from services.worker.host_copy import host_sampled, sampled_copy
from services.worker.prompt_logprobs import PromptRows, prompt_logprobs
from services.worker.runners.reference_runner import RunnerOutput
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.sampling.token_counts import TokenCounts
from services.worker.spec.speculator import Speculator
from services.worker.worker_output import WorkerOutput


class Runner(Protocol):
    """What a Worker runs: ModelRunner, DecodeStepGraphs, ReferenceRunner, or a test's stand-in."""

    def execute(self, plan: StepPlan) -> RunnerOutput: ...

    # A runner that takes async plans also accepts ``pending=PendingInputs`` (see ModelRunner).

    def release(self, request_id: str) -> None: ...


@dataclasses.dataclass
class LaunchedStep:
    """A step whose forward ``Worker.launch`` queued, waiting for ``Worker.sample``."""

    plan: StepPlan
    rows: list[SamplingRow]  # one per sampled row, in ``plan.sample_rows`` order
    out: RunnerOutput  # the runner's logits of the sampled rows (and taps), on the device
    pending: PendingInputs | None  # the previous step's tokens that filled this plan's pending inputs
    every_row: torch.Tensor | None  # every row's logits, when prompt rows' logprobs were asked for
    prompt_rows: PromptRows | None  # those prompt rows


class Worker:
    in_process = True  # takes the async and host extras (services/engine/step_worker.py, StepWorker.in_process)
    num_losses = 0  # in this process the pools are never lost (StepWorker.num_losses; RemoteWorker counts a process's)

    def __init__(self, runner: Runner, sampler: Sampler | None = None, speculator: Speculator | None = None) -> None:
        """``sampler`` defaults to the runner's backend's: ``KernelSampler`` on its kernel set's sampler
        module for a ``backend == "kernels"`` runner whose set has one (services/worker/sampling/kernel_sampler.py),
        else ``Sampler`` (a set's None parts stay torch, services/worker/kernel_model/fp8_linear.py).
        ``speculator`` (speculative decoding) verifies and proposes drafts; its runner must return taps."""
        self.runner = runner
        self.speculator = speculator
        if sampler is None and getattr(runner, "backend", "torch") == "kernels":
            from services.worker.sampling.kernel_sampler import KernelSampler

            kernels = runner.kernels  # type: ignore[attr-defined]
            if kernels.sampler is not None:
                sampler = KernelSampler(kernels.sampler)  # type: ignore[assignment]
        self.sampler = sampler or Sampler()
        # The speculator verifies on the torch Sampler's processed distributions (``Sampler.process``), which the
        # fused sampling kernel does not expose: on the kernel backend it gets its own torch Sampler.
        self.spec_sampler = self.sampler if isinstance(self.sampler, Sampler) else Sampler()
        # The penalties' per-request token counts on the sampler's device (slots named by the engine).
        self.token_counts: TokenCounts | None = None

    def execute(
        self,
        plan: StepPlan,
        rows: Sequence[SamplingRow],
        previous: WorkerOutput | None = None,
        prompt_rows: PromptRows | None = None,
        token_bitmask: torch.Tensor | Callable[[], torch.Tensor | None] | None = None,
    ) -> WorkerOutput:
        """``rows`` has one entry per sampled row, in ``plan.sample_rows`` order. ``previous`` (async
        scheduling) is the step before this one, whose sampled tokens fill this plan's pending inputs.
        ``prompt_rows``: prompt rows whose logprobs the step returns (``WorkerOutput.prompt_logprobs``).
        ``token_bitmask``: the structured-output mask, one row per ``rows`` entry (sampling/token_bitmask.py), None
        when no row is constrained, or the function that fills it (called once the forward is launched, so on a GPU
        the fill overlaps it). The same as ``sample(launch(...), token_bitmask)``."""
        launched = self.launch(plan, rows, previous, prompt_rows)
        return self.sample(launched, token_bitmask() if callable(token_bitmask) else token_bitmask)

    def launch(
        self,
        plan: StepPlan,
        rows: Sequence[SamplingRow],
        previous: WorkerOutput | None = None,
        prompt_rows: PromptRows | None = None,
    ) -> LaunchedStep:
        """The step's forward, queued (on a GPU; run, on the CPU), without its sampling: ``sample`` finishes it.
        Between the two the host may read the step before it and fill this one's token bitmask (async scheduling
        with structured output: the mask needs the previous step's tokens, the forward does not)."""
        pending = previous.pending_inputs() if previous is not None and any(plan.inputs_pending.tolist()) else None
        kwargs: dict = {"pending": pending} if pending is not None else {}
        every_row = None
        if prompt_rows is not None:  # every row's logits, the sampled rows picked out below
            out = self.runner.execute(plan, True, **kwargs)  # type: ignore[call-arg]
            every_row = out.logits
            sample_rows = upload(torch.tensor(plan.sample_rows.tolist(), dtype=torch.int64), every_row.device)
            out = dataclasses.replace(out, logits=every_row[sample_rows])
        else:
            out = self.runner.execute(plan, **kwargs)
        return LaunchedStep(plan, list(rows), out, pending, every_row, prompt_rows)

    def sample(self, step: LaunchedStep, token_bitmask: torch.Tensor | None = None) -> WorkerOutput:
        """Samples a launched step (verifies and proposes drafts, with a speculator): its ``WorkerOutput``."""
        plan, rows, out, pending = step.plan, step.rows, step.out, step.pending
        every_row, prompt_rows = step.every_row, step.prompt_rows
        num_sample_rows = plan.num_sample_rows.tolist()
        request_ids = list(plan.request_ids)
        if self.speculator is not None and plan.num_rows and not plan.is_placeholder:
            if out.taps is None:
                raise ValueError("speculative decoding needs a runner that returns the draft's taps (with_taps=True)")
            cache = getattr(self.runner, "cache", None)
            if cache is None:
                raise ValueError(
                    "speculative decoding needs the cached runner: the draft's rings live in its "
                    "CacheEngine's state slots"
                )
            positions = None
            if pending is not None and pending.num_rejected is not None:  # async: the seqlen fix-up's host side
                positions, rows = shifted(plan, rows, pending_shifts(plan, pending))
            sampled, result = self.speculator.step(
                plan, rows, out.logits, out.taps, self.spec_sampler, cache, positions, token_bitmask
            )
            return WorkerOutput(
                result,
                sampled,
                out.expert_counts,
                out.num_rows_computed,
                request_ids,
                pending=speculative_pending(plan, result),
            )
        if not rows:
            result = StepResult([0] * plan.num_requests, [])
            output = WorkerOutput(
                result,
                None,
                out.expert_counts,
                out.num_rows_computed,
                request_ids,
                torch.full((plan.num_requests,), -1, dtype=torch.long),
            )
            output.prompt_logprobs = prompt_logprobs(every_row, prompt_rows) if prompt_rows is not None else None
            return output
        counts = self._token_counts(rows, out.logits)
        if token_bitmask is not None:
            sampled = self.sampler(out.logits, rows, counts, token_bitmask)  # type: ignore[call-arg]
        elif counts is None:
            sampled = self.sampler(out.logits, rows)
        else:  # the penalties read the counts in place; this step's tokens are counted right after, on the device
            sampled = self.sampler(out.logits, rows, counts)  # type: ignore[call-arg]
        if counts is not None:
            counts.record([r.history if r.has_penalties else None for r in rows], sampled.token_ids)
        host = sampled_copy(sampled)  # queued now, before the engine queues the next step
        prompt = prompt_logprobs(every_row, prompt_rows) if prompt_rows is not None else None

        def read_back() -> StepResult:  # the one device → host copy of a step, waited for here
            on_host = host_sampled(host)
            tokens = on_host.token_ids.tolist()
            failed = on_host.errors.tolist()
            num_tokens, token_ids, errors = [], [], []
            row = 0
            for i, n in enumerate(num_sample_rows):
                # Without drafts every sampled row is one request's one token (nextn = 0).
                if n and any(failed[row : row + n]):
                    errors.append(i)
                    num_tokens.append(0)
                else:
                    num_tokens.append(n)
                    token_ids.extend(tokens[row : row + n])
                row += n
            return StepResult(num_tokens, token_ids, errors=errors)

        output = WorkerOutput(
            read_back,
            sampled,
            out.expert_counts,
            out.num_rows_computed,
            request_ids,
            last_tokens(sampled, num_sample_rows),
            host=host,
        )
        output.prompt_logprobs = prompt
        return output

    def _token_counts(self, rows: Sequence[SamplingRow], logits: torch.Tensor) -> TokenCounts | None:
        """The penalties' token counts (made on first use, on the logits' device), each slot a row's request opens
        with its first sampled row opened first; None when no row has penalties."""
        if not any(r.has_penalties for r in rows):
            return None
        if self.token_counts is None:
            self.token_counts = TokenCounts(logits.shape[1], logits.device)
        for row in rows:
            if row.history_prompt is not None and row.history is not None:
                self.token_counts.open(row.history, row.history_prompt)
        return self.token_counts

    def set_images(self, request_id: str, prompt_token_ids: list[int], rows: torch.Tensor) -> None:
        """Image embeddings [P, D] for the P placeholders of a request's prompt (services/worker/state/image_inputs.py),
        given before the request is first scheduled; ValueError when the runner takes no images."""
        set_images = getattr(self.runner, "set_images", None)
        if set_images is None:
            raise ValueError(f"{type(self.runner).__name__} takes no image embeddings")
        set_images(request_id, prompt_token_ids, rows)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)
        if self.speculator is not None:
            self.speculator.release(request_id)


def shifted(plan: StepPlan, rows: Sequence[SamplingRow], shifts: Sequence[int]) -> tuple[list[int], list[SamplingRow]]:
    """Async scheduling with drafts: the plan's row positions and its sampling rows' positions, each moved down
    by its request's shift (the rows its step in flight rejected), so every draw keeps its position's key."""
    row_requests = plan.row_requests.tolist()
    positions = [p - shifts[i] for p, i in zip(plan.positions.tolist(), row_requests)]
    owners = [row_requests[r] for r in plan.sample_rows.tolist()]
    return positions, [dataclasses.replace(row, position=row.position - shifts[i]) for row, i in zip(rows, owners)]


def speculative_pending(plan: StepPlan, result: StepResult) -> PendingInputs:
    """What a step with drafts hands the next one under async scheduling: per request its last emitted token
    (−1: none), its new drafts, and its rows the target did not accept (rows − tokens emitted; 0 for a prompt
    chunk, whose rows are all accepted)."""
    tokens, drafts, num_rejected = [], [], []
    emitted, proposed = 0, 0
    num_drafts = result.num_draft_tokens or [0] * plan.num_requests
    token_ids, draft_ids = result.token_ids, result.draft_token_ids
    num_decode = plan.num_decode_requests  # requests before it decode; the rest are prompt chunks
    for i, (n, q, k) in enumerate(zip(result.num_tokens, plan.seqlens_q.tolist(), num_drafts)):
        tokens.append(token_ids[emitted + n - 1] if n else -1)
        drafts.append(draft_ids[proposed : proposed + k])
        num_rejected.append(q - n if i < num_decode else 0)
        emitted, proposed = emitted + n, proposed + k
    return PendingInputs(list(plan.request_ids), torch.tensor(tokens, dtype=torch.long), drafts, num_rejected)


def last_tokens(sampled: SamplerOutput, num_sample_rows: Sequence[int]) -> torch.Tensor:
    """Per request, the token of its last sampled row, −1 where it sampled nothing or any of its rows
    failed: long [N] on the sampler's device, by device ops only (indices uploaded without a sync)."""
    device = sampled.token_ids.device
    ends, owners, has = [], [], []
    for i, n in enumerate(num_sample_rows):
        owners.extend([i] * n)
        if n:
            has.append(i)
            ends.append(len(owners) - 1)
    last = torch.full((len(num_sample_rows),), -1, dtype=torch.long, device=device)
    if not has:
        return last
    owner = upload(torch.tensor(owners, dtype=torch.long), device)
    failed = torch.zeros(len(num_sample_rows), dtype=torch.long, device=device)
    failed.scatter_add_(0, owner, sampled.errors.to(device=device, dtype=torch.long))
    idx = upload(torch.tensor(has, dtype=torch.long), device)
    token = sampled.token_ids[upload(torch.tensor(ends, dtype=torch.long), device)].long()
    last[idx] = torch.where(failed[idx] > 0, torch.full_like(token, -1), token)
    return last
