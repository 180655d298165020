"""The cached model runner: executes a StepPlan against the paged blocks and state slots.

One model call per step holds every row of every request (prefill chunks and decode rows alike,
concatenated as [1, R, ...] with per-row positions and request indices). Each layer runs the
model's own ``Block.run`` (Engram, mHC, norms, MoE) around ``AttentionStep.attend``; only the sampled
rows go through the final collapse, norm and head. Nothing recomputes a prefix: a step computes
exactly Σ seqlen_q rows.

A placeholder step (no rows; it exists so every data-parallel rank joins every collective) runs
nothing and counts nothing on a single rank, which has no collective to join. With expert parallelism
(``expert_parallel``, services/worker/parallel/) it runs one fake row on block 0 that routes to no expert
(services/worker/parallel/placeholder.py), so the rank makes every call of the step's exchanges.

``backend="kernels"`` (or ``EngineConfig.kernel_backend``) converts the model in place to its
kernel-backed form (services/worker/kernel_model/backend.py) and runs each step's attention on the
``TritonAttention`` backend (the ``TorchAttention`` one otherwise: services/worker/attention/step.py);
``precision`` is "fp8" (the default) or "fp32". It needs a CUDA device unless ``kernels`` are
interpreted copies (CPU tests).
"""

from __future__ import annotations

import contextlib

import torch

from kernels import invariance
from model.batch_invariant import batch_invariant
from model.deepseek_v41.mhc import collapse, initial_pre
from model.deepseek_v41.model import DeepseekV41
from scheduler_rs import StepPlan
from services.worker.attention.backend import AttentionBackend, Rounding, StepRounding
from services.worker.attention.step import AttentionStep
from services.worker.attention.torch_backend import TorchAttention
from services.worker.attention.triton_backend import TritonAttention
from services.worker.batch.step_batch import PendingInputs, StepBatch, check_ring_slots
from services.worker.config import WorkerConfig
from services.worker.kernel_model.backend import BACKENDS, check_device, convert_model
from services.worker.kernel_model.head import head_logits
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.parallel.ep_kernel_moe import shard_kernel_experts
from services.worker.parallel.ep_moe import ExpertParallel
from services.worker.parallel.placeholder import placeholder_batch
from services.worker.runners.reference_runner import RunnerOutput
from services.worker.state.cache_engine import CacheEngine, ring_size
from services.worker.state.engram_host import EngramHost
from services.worker.state.engram_rows import engram_rows
from services.worker.state.image_inputs import ImageInputs


class ModelRunner:
    def __init__(
        self,
        model: DeepseekV41,
        config: WorkerConfig,
        *,
        nextn: int = 0,
        rounding: Rounding | None = None,
        backend: str | None = None,
        precision: str | None = None,
        kernels: KernelSet | None = None,
        with_taps: bool = False,
        expert_parallel: ExpertParallel | None = None,
    ) -> None:
        """``with_taps``: every step also returns each row's DSpark target features (``RunnerOutput.taps``);
        ``expert_parallel``: the model's MoE layers are already sharded over ranks (``shard_experts``)."""
        self.expert_parallel = expert_parallel
        self.model = model
        self.with_taps = with_taps
        self.cfg = model.cfg
        device = model.embed.weight.device
        self.backend = backend or ("kernels" if config.kernel_backend is not None else "torch")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        self.precision = precision or config.kernel_backend or "fp8"
        self.kernels = None
        if self.backend == "kernels":
            self.kernels = kernels or KernelSet.compiled()
            check_device(device, self.kernels)
            self.conversion = convert_model(model, self.precision, self.kernels, config.expert_format)
            if expert_parallel is not None:  # the torch layers are sharded by the caller, the kernel ones here
                shard_kernel_experts(model, expert_parallel)
        # The Engram tables in host shared memory, a step's rows staged to the device (engram_on_host).
        self.engram_host = EngramHost.of_model(model) if config.engram_on_host else None
        self.cache = CacheEngine(
            self.cfg,
            config.block_size,
            config.num_blocks,
            config.num_state_slots,
            ring_size(self.cfg, nextn),
            device,
            draft=with_taps,
        )
        self.rounding = rounding
        if config.batch_invariant and self.backend == "torch" and device.type != "cpu":
            raise ValueError(
                "batch_invariant on a GPU runs on the kernel backend (docs/batch-invariance.md): "
                f"this runner is the torch backend on {device}; pass kernel_backend 'fp8' or 'fp32'"
            )
        self.batch_invariant = config.batch_invariant
        # Image embeddings per request (services/worker/state/image_inputs.py); None: a text-only model.
        self.images = ImageInputs(self.cfg.vision.image_token_id) if self.cfg.vision is not None else None

    def set_images(self, request_id: str, prompt_token_ids: list[int], rows: torch.Tensor) -> None:
        """The embeddings [P, D] of the P image placeholders of a request's prompt, before it is scheduled."""
        if self.images is None:
            raise ValueError("this model has no vision tower: it takes no image embeddings")
        self.images.put(request_id, prompt_token_ids, rows)

    def release(self, request_id: str) -> None:
        """Drops the request's image embeddings. Every other per-request byte lives in the pools, which
        the scheduler owns; a reused slot is never read before it is written (reads are bounded by positions)."""
        if self.images is not None:
            self.images.release(request_id)

    def execute(self, plan: StepPlan, all_rows: bool = False, *, pending: PendingInputs | None = None) -> RunnerOutput:
        """Logits [num sampled rows, vocab] fp32 in ``sample_rows`` order (every row, in row order,
        with ``all_rows``, for tests), expert counts [layers, experts], rows computed. A plan with
        pending inputs (async scheduling) needs ``pending``, the previous step's sampled tokens."""
        try:
            with torch.no_grad(), self.invariant():
                return self._execute(plan, all_rows, pending)
        finally:
            if self.expert_parallel is not None:
                self.expert_parallel.end_step()

    def invariant(self) -> contextlib.AbstractContextManager[None]:
        """The batch-invariant mode's context for this runner's steps (nothing when it is off): the CPU
        torch maths (model/batch_invariant.py) on the torch backend, fixed launch configurations
        (kernels/invariance.py) on the kernel backend."""
        if not self.batch_invariant:
            return contextlib.nullcontext()
        return batch_invariant() if self.kernels is None else invariance.fixed_configs()

    def _execute(self, plan: StepPlan, all_rows: bool, pending: PendingInputs | None) -> RunnerOutput:
        cfg, model = self.cfg, self.model
        self.cache.copy(plan.block_copies, plan.state_copies)
        device = model.embed.weight.device
        counts = torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.long, device=device)
        if self.expert_parallel is not None:  # every rank runs the group's most passes of the kernel MoE
            self.expert_parallel.agree_passes(0 if plan.is_placeholder else plan.num_rows)
        if plan.is_placeholder or plan.num_rows == 0:
            if self.expert_parallel is None:
                return RunnerOutput(torch.empty(0, cfg.vocab_size, device=device), counts, 0)
            with self.expert_parallel.placeholder():
                self._forward(placeholder_batch(plan.entry_ratios, device), all_rows=False, counts=counts)
            return RunnerOutput(torch.empty(0, cfg.vocab_size, device=device), counts, 0)
        if pending is None and any(plan.inputs_pending.tolist()):
            raise ValueError(
                "the plan's inputs wait on a step in flight (async scheduling); this runner needs them filled in"
            )
        check_ring_slots(plan, self.cache.layout.ring_size)
        batch = StepBatch.from_plan(plan, device)
        if pending is not None:
            batch.fill_pending(plan, pending, self.cache.layout.ring_size, self.cache.layout.block_size)
        return self._forward(batch, all_rows, counts)

    def _forward(self, batch: StepBatch, all_rows: bool, counts: torch.Tensor) -> RunnerOutput:
        cfg, model = self.cfg, self.model
        device = model.embed.weight.device
        rounding = StepRounding(self.rounding, batch.request_ids)
        backend: AttentionBackend = (
            TorchAttention(self.cache, batch, rounding)
            if self.kernels is None
            else TritonAttention(self.cache, batch, self.kernels, self.precision, rounding)
        )
        step = AttentionStep(backend, batch.positions, batch.row_requests, rounding)
        engram = engram_rows(self.cache, batch, model.hasher) if model.hasher is not None else None
        if engram is not None and self.engram_host is not None:
            engram = self.engram_host.stage(
                engram
            )  # as early as the rows are known: the copy overlaps the layers before
        ids = batch.input_ids.unsqueeze(0)  # [1, R]
        image_mask = image_rows = None
        if self.images is not None:
            image_mask, image_rows = self.images.step_rows(
                batch.request_ids, batch.input_ids, batch.positions, batch.row_requests
            )
        # The embedding step: image rows take their embeddings (image: [1, R] bool, or None without any).
        e, image = model.embed_inputs(
            ids,
            None if image_rows is None else image_rows.to(device),
            None if image_rows is None else image_mask.to(device).unsqueeze(0),
        )
        h = e.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)  # [1, R, n, D]
        pre = initial_pre(ids.shape, cfg.hc_mult, device)  # [1, R, n]
        taps: list[torch.Tensor] = []
        tapped = set(cfg.dspark_target_layer_ids) if self.with_taps else set()
        live = None if image is None else ~image  # image tokens are dead for Engram's gate
        for block in model.layers:

            def attend(x: torch.Tensor, attn=block.attn) -> torch.Tensor:
                return step.attend(attn, x[0]).unsqueeze(0)

            h, pre = block.run(
                h,
                pre,
                attend,
                engram,
                live,
                counts[block.layer],
                image=image,
                taps=taps if block.layer in tapped else None,
            )
        rows = torch.arange(batch.num_rows, device=device) if all_rows else batch.sample_rows
        final = collapse if self.kernels is None or self.kernels.mhc is None else self.kernels.mhc.collapse
        y = model.norm(final(h[:, rows], pre[:, rows]))[0]  # [rows, D]
        logits = head_logits(model.head, y)
        # counts stay on the device: no sync per step
        return RunnerOutput(logits, counts, batch.num_rows, torch.cat(taps, dim=-1)[0] if taps else None)
