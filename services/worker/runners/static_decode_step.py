"""The decode step with static shapes and device-only ops: what a CUDA graph captures.

A ``StaticDecodeStep`` of G rows owns a ``StaticBatch`` (services/worker/batch/static_batch.py: the
persistent input buffers; ``fill(plan)`` fills them, padding with placeholder rows). ``run()`` then
goes from the buffers to logits [G, vocab] and expert counts [layers, experts] with no host sync and
no data-dependent shape, so a graph replays it; the caller trims the placeholder rows' logits.

Per layer it runs the model's own ``Block.run`` (Engram, mHC, MoE) around ``AttentionStep.attend``
(services/worker/attention/step.py) on the graph-safe backend ``GraphAttention``
(attention_backend_graph.py), so a kernel backend's swapped modules drop in. ``attention`` picks that
backend's ops: "triton" runs the kernels, "reference" their static torch versions (CPU tests,
bit-identity with the eager torch backend). The MoE routes placeholder rows nowhere: ``KernelMoE``
takes the live-row mask (graph-safe); the torch MoE, whose expert loop syncs with the host and so is
never captured, runs on the live rows only (a prefix) and pads its output back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from model.deepseek_v41.attention import Attention
from model.deepseek_v41.mhc import collapse, initial_pre
from model.deepseek_v41.model import DeepseekV41
from scheduler_rs import StepPlan
from services.worker.attention.graph_backend import ATTENTION, GraphAttention, step_kernels
from services.worker.attention.step import AttentionStep
from services.worker.batch.static_batch import StaticBatch
from services.worker.batch.step_batch import PendingInputs
from services.worker.kernel_model.head import head_logits
from services.worker.kernel_model.moe import KernelMoE
from services.worker.parallel.ep_kernel_moe import ExpertParallelKernelMoE
from services.worker.state.cache_engine import CacheEngine
from services.worker.state.engram_host import EngramHost, local_rows
from services.worker.state.engram_rows import static_engram_rows


class StaticDecodeStep:
    def __init__(
        self,
        model: DeepseekV41,
        cache: CacheEngine,
        num_rows: int,
        max_blocks_per_request: int,
        *,
        attention: str,
        kernels: object | None = None,
        fp32_dots: bool | None = None,
        with_taps: bool = False,
        engram_host: EngramHost | None = None,
    ) -> None:
        """``kernels``: a KernelSet for the "triton" path (see ``step_kernels``); unused by "reference".
        ``fp32_dots``: the attention kernel's dot precision, as the eager ``TritonAttention`` picks it
        (precision "fp32" or interpreted kernels); None = fp32 for fp32 queries. Graph and eager steps
        must use the same, or the FP8 path's roundings diverge between them. ``with_taps``: ``run`` also
        returns every row's DSpark target features (speculative decoding), as ``ModelRunner`` does.
        ``engram_host``: the Engram tables live on the host (services/worker/state/engram_host.py): ``fill``
        computes the rows and stages them into this step's persistent device buffers, so ``run`` (what a
        graph captures) reads only those buffers and does no host work."""
        if attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
        self.model, self.cache, self.cfg = model, cache, model.cfg
        self.attention = attention
        self.kernels = step_kernels(kernels) if attention == "triton" else None
        # The final collapse as the eager runner takes it: the kernel set's mHC when it has one.
        mhc = getattr(kernels, "mhc", None)
        self.collapse = collapse if mhc is None else mhc.collapse
        self.fp32_dots = fp32_dots
        self.device = model.embed.weight.device
        self.tapped = set(self.cfg.dspark_target_layer_ids) if with_taps else set()
        self.rows = StaticBatch(
            self.cfg, num_rows, max_blocks_per_request, cache.layout.ring_size, self.device, cache.layout.block_size
        )
        self.backend = GraphAttention(cache, self.rows, self.kernels, fp32_dots)  # holds what a run's sources publish
        self.step = AttentionStep(self.backend, self.rows.positions, self.rows.row_requests)
        self.engram_host = engram_host
        self.engram_local: torch.Tensor | None = None  # [1, G, L, heads]: the staged rows' places (host tables)
        self.engram_buffers: list[dict[str, torch.Tensor]] | None = None  # per table: name → device [G·heads, ...]
        if engram_host is not None and model.hasher is not None:
            heads = self.cfg.engram_hash_heads()
            shape = torch.Size((1, num_rows, len(self.cfg.engram_layer_ids), heads))
            self.engram_local = local_rows(shape, self.device)
            self.engram_buffers = engram_host.static_buffers(num_rows * heads)

    @property
    def num_rows(self) -> int:
        return self.rows.num_rows

    @staticmethod
    def fits(plan: StepPlan) -> bool:
        """A decode plan with rows (1 + the drafts verified per request), a graph size chosen."""
        return StaticBatch.fits(plan)

    def fill(self, plan: StepPlan, pending: PendingInputs | None = None) -> None:
        """Fill the buffers from ``plan`` (host work; before a replay). Rows past the plan's are placeholders."""
        self.rows.fill(plan, pending)
        self._stage_engram()

    def fill_placeholders(self) -> None:
        """Every row a placeholder (graph warm-up and capture): the step then touches only block 0 / slot 0."""
        self.rows.fill_placeholders()
        self._stage_engram()

    def _stage_engram(self) -> None:
        """Host tables: this step's Engram rows (writing the history, as ``run`` does otherwise), gathered on
        the host and copied into the persistent buffers a replay reads."""
        if self.engram_buffers is None:
            return
        r = self.rows
        with torch.no_grad():
            rows = static_engram_rows(
                self.cache, self.model.hasher, r.input_ids, r.positions, r.state_slots, r.row_first, r.row_seqlens_k
            )
            self.engram_host.stage(rows, self.engram_buffers)

    @torch.no_grad()
    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Buffers → (logits fp32 [G, vocab], expert counts int64 [layers, experts] of the live rows, and with
        taps the DSpark target features fp32 [G, T·D], else None)."""
        cfg, model, r = self.cfg, self.model, self.rows
        counts = torch.zeros(cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.long, device=self.device)
        engram = self.engram_local  # host tables: staged by fill
        if model.hasher is not None and engram is None:
            engram = static_engram_rows(
                self.cache, model.hasher, r.input_ids, r.positions, r.state_slots, r.row_first, r.row_seqlens_k
            )
        ids = r.input_ids.unsqueeze(0)  # [1, G]
        h = model.embed(ids).unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)  # [1, G, n, D]
        pre = initial_pre(ids.shape, cfg.hc_mult, self.device)  # [1, G, n]
        self.backend.reset()
        self.step.reset()
        taps: list[torch.Tensor] = []
        for block in self.model.layers:

            def attend(x: torch.Tensor, attn: Attention = block.attn) -> torch.Tensor:
                return self.step.attend(attn, x[0]).unsqueeze(0)

            with self._live_rows(block.ffn, counts[block.layer]):
                h, pre = block.run(
                    h, pre, attend, engram, None, None, taps=taps if block.layer in self.tapped else None
                )
        y = model.norm(self.collapse(h, pre))[0]  # [G, D]
        return head_logits(model.head, y), counts, torch.cat(taps, dim=-1)[0] if taps else None

    @contextlib.contextmanager
    def _live_rows(self, ffn: torch.nn.Module, counts: torch.Tensor) -> Iterator[None]:
        """``Block.run`` calls ``ffn(x, None)``, x [1, G, D]: these hooks route the live rows only and
        count them into ``counts`` [E]. ``KernelMoE`` (and its expert-parallel form) takes the row mask; the
        torch MoE runs on the live prefix and its output is padded back with zeros (shapes vary: never captured)."""
        r = self.rows
        if isinstance(ffn, (KernelMoE, ExpertParallelKernelMoE)):  # graph-safe: the mask is a device tensor
            hooks = [
                ffn.register_forward_pre_hook(
                    lambda _m, args, _kw: ((args[0], counts), {"live": r.live}), with_kwargs=True
                )
            ]
        else:
            n, pad = r.num_live, r.num_rows - r.num_live
            hooks = [
                ffn.register_forward_pre_hook(lambda _m, args: (args[0][:, :n], counts)),
                ffn.register_forward_hook(lambda _m, _args, out: F.pad(out, (0, 0, 0, pad))),
            ]
        try:
            yield
        finally:
            for hook in hooks:
                hook.remove()
