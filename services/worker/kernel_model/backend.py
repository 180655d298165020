"""The worker's GPU kernel backend: the model's modules swapped for kernel-backed ones (composition);
its attention backend is ``TritonAttention`` (services/worker/attention/triton_backend.py), its sampler
``KernelSampler`` (services/worker/sampling/kernel_sampler.py).

``convert_model(model, precision)`` replaces, in place:

- every ``RMSNorm`` → ``KernelRMSNorm`` (``kernels.rmsnorm``);
- every ``MoE`` → ``KernelMoE`` (``kernels.moe_router`` + ``kernels.moe_grouped_gemm.moe_experts``,
  the shared expert stacked as one more expert);
- the projections stored FP8 in the checkpoint (attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_b``;
  indexer ``wq_b``; Engram ``wkv``) → ``KernelLinear``, and attention's grouped ``wo_a`` →
  ``GroupedKernelLinear`` (services/worker/kernel_model/fp8_linear.py);
- every mHC site ``HyperConnection`` → ``KernelHyperConnection`` (``kernels.mhc``), when the kernel set
  has ``mhc``: per layer ``Block.run`` makes three mHC launches, the attention site's Mix + collapse
  (``mhc_mix``), the attention expand fused with the FFN site's Mix + collapse (``mhc_expand_mix``),
  and the FFN expand.

The DSpark draft (``model.draft``) converts with the rest: its norms, its stages' mHC sites, attention
projections (``wo_a`` grouped: ``Attention.project`` takes the converted module) and MoE, and its block
attention ``DraftAttention`` → ``KernelDraftAttention`` (services/worker/kernel_model/draft_attention.py: RoPE,
the own keys' FP8 rounding, the softmax over window and block and the inverse RoPE in one launch per stage),
when the kernel set has ``draft_attention``. Its ``main_proj``, Markov head and confidence projection stay torch.

Each ``Engram`` → ``KernelEngram`` (services/worker/kernel_model/engram.py: its gate and residual add on
``kernels.engram_gate``, one program per token and stream, so row-invariant in both modes) when the kernel
set has ``engram_gate``, else ``RowTiledEngram``. The indexer's ``weights_proj`` → ``RowTiledLinear``
(services/worker/kernel_model/row_tiled.py: the same torch maths, on fixed row tiles in the batch-invariant mode).

With ``precision="fp8"``, the output head → ``KernelHead`` (services/worker/kernel_model/head.py: its bf16
weight read as bf16, fp32 logits) when its weight is exact in bf16, as the checkpoint's is.

Left as torch: the projections the checkpoint stores in bf16 (compressor ``wkv``/``wgate``, indexer
``wk``/``weights_proj``, the router gate's fp32 logits are the router kernel's), which
would not be exact in e4m3; the compressor kernel reads ``wk`` and the norms' weights itself
(kernels/compressor.py ``compress_layer``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from model.deepseek_v41.attention import Attention
from model.deepseek_v41.draft_attention import DraftAttention
from model.deepseek_v41.engram import Engram
from model.deepseek_v41.indexer import Indexer
from model.deepseek_v41.mhc import HyperConnection, Mix
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.norm import RMSNorm
from services.worker.kernel_model.draft_attention import KernelDraftAttention
from services.worker.kernel_model.engram import KernelEngram
from services.worker.kernel_model.fp8_linear import PRECISIONS, GroupedKernelLinear, KernelLinear
from services.worker.kernel_model.head import KernelHead, exact_in_bf16
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.kernel_model.moe import KernelMoE, KernelRMSNorm
from services.worker.kernel_model.row_tiled import RowTiledEngram, RowTiledLinear

__all__ = ["BACKENDS", "Conversion", "KernelHyperConnection", "KernelSet", "check_device", "convert_model"]

BACKENDS = ("torch", "kernels")
FP8_PROJECTIONS = {"Attention": ("wq_a", "wq_b", "wkv", "wo_b"), "Indexer": ("wq_b",), "Engram": ("wkv",)}
"""Per module class, the nn.Linear children whose checkpoint weights are FP8 (checkpoint.py's fp8_block)."""


@dataclass
class Conversion:
    """What ``convert_model`` replaced, and how many FP8 weight elements were not exact at 128×128."""

    norms: int = 0
    moes: int = 0
    draft_moes: int = 0  # of the moes, the DSpark draft's stages'
    draft_modules: int = 0  # of every module replaced, the DSpark draft's
    linears: int = 0
    grouped: int = 0
    mhc_sites: int = 0
    draft_attentions: int = 0  # the DSpark draft's block attention → ``KernelDraftAttention`` (one per draft)
    inexact: int = 0


def check_device(device: torch.device, kernels: KernelSet) -> None:
    if device.type != "cuda" and not kernels.interpreted:
        raise ValueError(
            f"backend='kernels' needs a CUDA device (its Triton kernels are compiled for the GPU), "
            f"got {device}; on CPU pass interpreted kernels (kernels/interpret.py) explicitly"
        )


def convert_model(
    model: nn.Module, precision: str = "fp8", kernels: KernelSet | None = None, expert_format: str = "fp8"
) -> Conversion:
    """Swap the modules of ``model`` (a ``DeepseekV41`` or any part of one, e.g. one ``Block``) for
    kernel-backed ones, in place (see the module docstring). Modules already converted are left as
    they are, so converting twice (layer by layer, then the whole model) is harmless. ``expert_format``:
    the routed experts kept MXFP4 ("fp4", services/worker/kernel_model/fp4_experts.py) or FP8 ("fp8")."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    kernels = kernels or KernelSet.compiled()
    tensor = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers())
    check_device(tensor.device, kernels)
    done = Conversion()
    # The DSpark draft's modules convert like the target's (its attention's grouped ``wo_a`` goes through
    # ``Attention.project_out``, which takes a converted one): counted apart as well.
    draft = getattr(model, "draft", None)
    draft_parents = set(draft.modules()) if isinstance(draft, nn.Module) else set()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new: nn.Module | None = None
            in_draft = parent in draft_parents
            if isinstance(child, RMSNorm):
                new, done.norms = KernelRMSNorm(child, kernels), done.norms + 1
            elif isinstance(child, DraftAttention) and kernels.draft_attention is not None:
                new, done.draft_attentions = KernelDraftAttention(kernels), done.draft_attentions + 1
            elif isinstance(child, HyperConnection) and kernels.mhc is not None:
                new, done.mhc_sites = KernelHyperConnection(child, kernels), done.mhc_sites + 1
            elif isinstance(child, MoE):
                new, done.moes = KernelMoE(child, precision, kernels, expert_format), done.moes + 1
                done.draft_moes += in_draft
            elif isinstance(parent, Attention) and name == "wo_a" and isinstance(child, nn.Linear):
                new = GroupedKernelLinear(child.weight, parent.num_groups, precision, kernels)
                done.grouped += 1
            elif (
                precision == "fp8"
                and name == "head"
                and type(parent).__name__ == "DeepseekV41"
                and isinstance(child, nn.Linear)
                and exact_in_bf16(child.weight)
            ):
                new = KernelHead(child.weight)
            elif isinstance(child, nn.Linear) and name in FP8_PROJECTIONS.get(type(parent).__name__, ()):
                new, done.linears = KernelLinear(child.weight, precision, kernels), done.linears + 1
            elif isinstance(parent, Indexer) and name == "weights_proj" and isinstance(child, nn.Linear):
                new = RowTiledLinear(child)
            elif isinstance(child, Engram) and not isinstance(parent, (RowTiledEngram, KernelEngram)):
                new = RowTiledEngram(child) if kernels.engram_gate is None else KernelEngram(child, kernels)
            if new is not None:
                done.inexact += getattr(new, "inexact", 0)
                done.draft_modules += in_draft
                setattr(parent, name, new)
    return done


class KernelHyperConnection(nn.Module):
    """One mHC site on ``kernels.mhc``, with ``HyperConnection``'s interface (``forward`` → Mix,
    ``mix_collapse``, ``expand``; Mix fields shaped like the model's: [..., n], [..., n, n])."""

    def __init__(self, hc: HyperConnection, kernels: KernelSet) -> None:
        super().__init__()
        self.kernels, self.n = kernels, hc.n
        self.iters, self.eps, self.norm_eps = hc.iters, hc.eps, hc.norm_eps
        w = kernels.mhc.MixWeights.of(hc)  # fn split once into a tf32-exact part and the rest
        self.register_buffer("fn_split", w.fn_split)  # [2, n(n+2), n·D]
        self.register_buffer("base", w.base)  # [n(n+2)]
        self.register_buffer("scale", w.scale)  # [3]

    def _weights(self):
        return self.kernels.mhc.MixWeights(self.fn_split, self.base, self.scale, self.iters, self.eps, self.norm_eps)

    def _mix(self, mix: Mix, lead: torch.Size) -> Mix:
        n = self.n
        return Mix(mix.pre.view(*lead, n), mix.post.view(*lead, n), mix.comb.view(*lead, n, n))

    def forward(self, h: torch.Tensor) -> Mix:  # h [..., n, D]
        return self._mix(self.kernels.mhc.mhc_mix(h, self._weights()).mix, h.shape[:-2])

    def mix_collapse(self, h: torch.Tensor, pre: torch.Tensor) -> tuple[Mix, torch.Tensor]:
        """(Mix(h), Collapse(h, pre)) from one read of h [..., n, D]; pre fp32 [..., n]."""
        result = self.kernels.mhc.mhc_mix(h, self._weights(), pre)
        return self._mix(result.mix, h.shape[:-2]), result.x.view(*h.shape[:-2], h.shape[-1])

    def expand(self, y: torch.Tensor, h: torch.Tensor, mix: Mix) -> torch.Tensor:
        return self.kernels.mhc.expand(y, h, mix)

    def expand_mix_collapse(
        self, y: torch.Tensor, h: torch.Tensor, previous: Mix
    ) -> tuple[torch.Tensor, Mix, torch.Tensor]:
        """h' = Expand(y, h, previous), Mix(h'), Collapse(h', previous.pre): one kernel, one read of y and h."""
        lead = h.shape[:-2]
        result = self.kernels.mhc.mhc_expand_mix(y, h, previous, self._weights(), previous.pre)
        return result.h.view(h.shape), self._mix(result.mix, lead), result.x.view(*lead, h.shape[-1])
