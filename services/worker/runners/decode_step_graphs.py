"""CUDA graphs for decode: one captured ``StaticDecodeStep`` per row count (docs/architecture.md, "The step loop").

The scheduler gives every decode plan a ``graph_size``: the smallest of ``graph_sizes`` (powers of
two up to the interval, then its multiples up to max_num_seqs × (1 + nextn)) that holds its rows.
``DecodeStepGraphs.execute`` fills that size's static buffers from the plan and replays its graph; the
padding rows are placeholders (null block 0 / null slot 0, no expert counted) and their logits are
trimmed before the output. On CPU (``use_graphs=False``) the same static step runs eagerly, so CI
tests the code a graph captures.

With speculative decoding a decode plan has 1 + the drafts verified rows per request, and graph sizes
count rows, so verify steps replay graphs too (the static step orders a request's ring, partial-group
and Engram writes within the step as the eager runner does) and return the draft's taps. Under async
scheduling a step whose inputs wait on a step with drafts gets the seqlen fix-up on the host before
its buffers are filled (the rejected counts and drafts are host lists).

Every other plan (prefill chunks, a prefill step mixing decode rows, a placeholder step) goes to the
wrapped ModelRunner's eager path. That is the design, not a fallback: those steps are long enough that
launches do not dominate (or, for a placeholder, do nothing here), and their row counts and shapes vary
too much to capture.

With expert parallelism on the kernel backend (a data-parallel rank, services/worker/parallel/ep_kernel_moe.py)
every step first agrees on the group's passes (``ExpertParallel.agree_passes``, a host all-reduce): a decode
step replays its graph when the group's step is one pass (every rank's exchange then has the graph's fixed
shapes, whether a peer replays or runs eagerly), else runs eagerly with the group's passes. A placeholder step
(a rank with no work in a lockstep step) replays the smallest graph with every row a placeholder: its rows route
to no expert and it still makes every exchange of the step.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from kernels.device import upload
from scheduler_rs import StepPlan
from services.worker.batch.step_batch import PendingInputs
from services.worker.config import WorkerConfig
from services.worker.graphs.capture import capture_graph
from services.worker.runners.model_runner import ModelRunner
from services.worker.runners.reference_runner import RunnerOutput
from services.worker.runners.static_decode_step import StaticDecodeStep
from services.worker.state.cache_engine import CacheEngine

log = logging.getLogger(__name__)


class DecodeStepGraphs:
    """Wraps (does not subclass) a ModelRunner: same ``execute`` contract, same cache pools.

    ``attention`` picks the static step's compressor, indexer and decode attention explicitly
    ("triton": the kernels/ kernels, from ``kernels`` or else the runner's kernel set where they are in
    it, compiled otherwise; "reference": their static torch versions). ``use_graphs`` captures and
    replays CUDA graphs; without it the static step runs eagerly (CPU, tests). Captured graphs need a
    graph-safe MoE: the kernel backend's (``ModelRunner(backend="kernels")``)."""

    def __init__(
        self,
        runner: ModelRunner,
        config: WorkerConfig,
        *,
        use_graphs: bool,
        attention: str,
        kernels: object | None = None,
    ) -> None:
        if runner.rounding is not None:
            raise ValueError("a rounding hook calls back into Python per op: run such a ModelRunner eagerly")
        device = runner.model.embed.weight.device
        if use_graphs and device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on CUDA, not {device}")
        if use_graphs and runner.kernels is None:
            raise ValueError(
                "CUDA graphs need the kernel backend (ModelRunner(backend='kernels')): the torch "
                "MoE's expert loop reads routing on the host, which a capture refuses"
            )
        self.runner = runner
        self.use_graphs = use_graphs
        self.attention = attention
        self.kernels = kernels if kernels is not None else runner.kernels
        self.max_blocks_per_request = -(-config.max_model_len // config.block_size)
        self._steps: dict[int, StaticDecodeStep] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # graph size → its (logits, counts, taps or None)
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._pool: Any = None  # one memory pool shared by every graph (they never run at once)
        self.num_replays = 0
        self.num_eager = 0

    @property
    def backend(self) -> str:
        """The wrapped runner's ("kernels": the Worker then samples with its kernel set's sampler)."""
        return self.runner.backend

    @property
    def cache(self) -> CacheEngine:
        """The wrapped runner's pools (the speculator reads and writes the draft's rings there)."""
        return self.runner.cache

    def set_images(self, request_id: str, prompt_token_ids: list[int], rows: torch.Tensor) -> None:
        """The wrapped runner's: image placeholders are prompt rows, and prompt rows (prefill plans) always
        run on its eager path; a decode row is a generated token, never an image."""
        self.runner.set_images(request_id, prompt_token_ids, rows)

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)

    def _fp32_dots(self) -> bool | None:
        """The eager kernel backend's choice (``TritonAttention.fp32_dots``), so graph and eager steps agree."""
        precision = getattr(self.runner, "precision", None)
        return None if getattr(self.runner, "kernels", None) is None else precision == "fp32"

    def step(self, size: int) -> StaticDecodeStep:
        if size not in self._steps:
            self._steps[size] = StaticDecodeStep(
                self.runner.model,
                self.runner.cache,
                size,
                self.max_blocks_per_request,
                attention=self.attention,
                kernels=self.kernels,
                fp32_dots=self._fp32_dots(),
                with_taps=self.runner.with_taps,
                engram_host=self.runner.engram_host,
            )
        return self._steps[size]

    def capture(self, sizes: list[int]) -> None:
        """Capture the graphs of ``sizes`` now (largest first, so the smaller ones reuse its memory)."""
        for size in sorted(sizes, reverse=True):
            if size not in self._graphs:
                self._capture(size)

    def _capture(self, size: int) -> None:
        with self.runner.invariant():  # the launch choices a capture records are the mode's
            self._capture_in_mode(size)

    def _capture_in_mode(self, size: int) -> None:
        step = self.step(size)
        # Placeholder rows only: the warm-up (which really runs) writes nothing but block 0 / slot 0.
        step.fill_placeholders()
        graph, self._outputs[size], self._pool = capture_graph(step.run, self._pool)
        self._graphs[size] = graph
        log.info("captured the decode graph of %d rows", size)

    @torch.no_grad()
    def execute(self, plan: StepPlan, all_rows: bool = False, *, pending: PendingInputs | None = None) -> RunnerOutput:
        """``ModelRunner.execute``'s result: logits of the plan's rows only (the padding trimmed)."""
        parallel = self.runner.expert_parallel
        if parallel is None:
            return self._execute(plan, all_rows, pending)
        try:
            passes = parallel.agree_passes(0 if plan.is_placeholder else plan.num_rows)
            if plan.is_placeholder or plan.num_rows == 0:
                return self._placeholder(plan)
            if passes > 1:
                self.num_eager += 1
                return self.runner.execute(plan, all_rows, pending=pending)
            return self._execute(plan, all_rows, pending)
        finally:
            parallel.end_step()

    def _placeholder(self, plan: StepPlan) -> RunnerOutput:
        """A rank's placeholder step: the smallest static step, every row a placeholder (module docstring)."""
        self.runner.cache.copy(plan.block_copies, plan.state_copies)
        size = min(self._graphs) if self._graphs else min(self._steps, default=1)
        step = self.step(size)
        step.fill_placeholders()
        if self.use_graphs:
            if size not in self._graphs:
                self._capture(size)
            self._graphs[size].replay()
            _, counts, _ = self._outputs[size]
            self.num_replays += 1
        else:
            with self.runner.invariant():
                _, counts, _ = step.run()
        vocab = self.runner.cfg.vocab_size
        return RunnerOutput(torch.empty(0, vocab, device=counts.device), counts.clone(), 0)

    def _execute(self, plan: StepPlan, all_rows: bool, pending: PendingInputs | None) -> RunnerOutput:
        if not StaticDecodeStep.fits(plan):
            self.num_eager += 1
            return self.runner.execute(plan, all_rows, pending=pending)
        cache = self.runner.cache
        cache.copy(plan.block_copies, plan.state_copies)
        size = plan.graph_size
        assert size is not None  # fits() checked it
        step = self.step(size)
        step.fill(plan, pending)
        if self.use_graphs:
            if size not in self._graphs:
                self._capture(size)
                step.fill(plan, pending)  # the capture ran placeholders through the buffers
            self._graphs[size].replay()
            logits, counts, taps = self._outputs[size]
            self.num_replays += 1
        else:
            with self.runner.invariant():
                logits, counts, taps = step.run()
        n = plan.num_rows
        rows = torch.arange(n) if all_rows else torch.tensor(plan.sample_rows.tolist(), dtype=torch.long)
        # Indexing copies, so the next replay cannot overwrite what is returned; nothing is read back
        # here (the counts too stay on the device), so the host can plan the next step meanwhile.
        return RunnerOutput(
            logits[upload(rows, logits.device)], counts.clone(), n, taps[:n].clone() if taps is not None else None
        )
