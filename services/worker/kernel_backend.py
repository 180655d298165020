"""The worker's GPU kernel backend: the model's modules swapped for kernel-backed ones (composition),
and a step whose decode rows attend through ``kernels.decode_attention`` on the packed pools.

``convert_model(model, precision)`` replaces, in place:

- every ``RMSNorm`` → ``KernelRMSNorm`` (``kernels.rmsnorm``);
- every ``MoE`` → ``KernelMoE`` (``kernels.moe_router`` + ``kernels.moe_grouped_gemm.moe_experts``,
  the shared expert stacked as one more expert);
- the projections stored FP8 in the checkpoint (attention ``wq_a``, ``wq_b``, ``wkv``, ``wo_b``;
  indexer ``wq_b``; Engram ``wkv``) → ``KernelLinear``, and attention's grouped ``wo_a`` →
  ``GroupedKernelLinear`` (services/worker/fp8_linear.py).

Left as torch: the projections the checkpoint stores in bf16 (compressor ``wkv``/``wgate``, indexer
``wk``/``weights_proj``, the router gate's fp32 logits are the router kernel's, the head), which
would not be exact in e4m3 and which ``CachedStep`` partly reads as raw ``.weight`` tensors; they
belong to the compressor / indexer kernels (kernels/compressor.py, kernels/indexer.py).

``KernelStep`` wraps a ``CachedStep``: the projections before and after attention run through the
converted modules; rows whose request has one row this step (decode rows: its window is the ring
plus this row) attend with ``sparse_decode_attention`` straight from the window ring and the
compressed-entry pool; other rows keep CachedStep's torch attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kernels.reference import entry_slots
from model.deepseek_v41.attention import Attention, sink_attention
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.norm import RMSNorm
from model.deepseek_v41.rope import apply_rope, rope_angles
from services.worker.cached_step import CachedStep
from services.worker.fp8_linear import PRECISIONS, GroupedKernelLinear, KernelLinear, KernelSet
from services.worker.kernel_moe import KernelMoE, KernelRMSNorm

BACKENDS = ("torch", "kernels")
FP8_PROJECTIONS = {"Attention": ("wq_a", "wq_b", "wkv", "wo_b"), "Indexer": ("wq_b",), "Engram": ("wkv",)}
"""Per module class, the nn.Linear children whose checkpoint weights are FP8 (checkpoint.py's fp8_block)."""


@dataclass
class Conversion:
    """What ``convert_model`` replaced, and how many FP8 weight elements were not exact at 128×128."""

    norms: int = 0
    moes: int = 0
    linears: int = 0
    grouped: int = 0
    inexact: int = 0


def check_device(device: torch.device, kernels: KernelSet) -> None:
    if device.type != "cuda" and not kernels.interpreted:
        raise ValueError(f"backend='kernels' needs a CUDA device (its Triton kernels are compiled for the GPU), "
                         f"got {device}; on CPU pass interpreted kernels (tests/kernels/interpret.py) explicitly")


def convert_model(model: nn.Module, precision: str = "fp8", kernels: KernelSet | None = None) -> Conversion:
    """Swap the modules of ``model`` (a ``DeepseekV41`` or any part of one, e.g. one ``Block``) for
    kernel-backed ones, in place (see the module docstring). Modules already converted are left as
    they are, so converting twice (layer by layer, then the whole model) is harmless."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    kernels = kernels or KernelSet.compiled()
    tensor = next(model.parameters(), None)
    if tensor is None:
        tensor = next(model.buffers())
    check_device(tensor.device, kernels)
    done = Conversion()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new: nn.Module | None = None
            if isinstance(child, RMSNorm):
                new, done.norms = KernelRMSNorm(child, kernels), done.norms + 1
            elif isinstance(child, MoE):
                new, done.moes = KernelMoE(child, precision, kernels), done.moes + 1
            elif isinstance(parent, Attention) and name == "wo_a" and isinstance(child, nn.Linear):
                new = GroupedKernelLinear(child.weight, parent.num_groups, precision, kernels)
                done.grouped += 1
            elif isinstance(child, nn.Linear) and name in FP8_PROJECTIONS.get(type(parent).__name__, ()):
                new, done.linears = KernelLinear(child.weight, precision, kernels), done.linears + 1
            if new is not None:
                done.inexact += getattr(new, "inexact", 0)
                setattr(parent, name, new)
    return done


class KernelStep:
    """A ``CachedStep`` whose attention runs on the converted modules and, for decode rows, on
    ``sparse_decode_attention``. Composition: the wrapped step keeps its batch, pools, rounding hook
    and sparse state; ``engram_rows`` is its own.

    TODO(kernels/prefill_attention.py): rows of requests with several rows this step (prefill
    chunks) still take the torch attention below (``_torch_rows``); the prefill kernel plugs in there.
    """

    def __init__(self, step: CachedStep, kernels: KernelSet, precision: str) -> None:
        self.step, self.kernels, self.precision = step, kernels, precision
        b = step.b
        rows_per_request = b.query_start[1:] - b.query_start[:-1]  # [N]
        decode = (rows_per_request == 1)[b.row_requests]  # [R]
        self.all_decode = bool(decode.all())
        self.decode_rows = None if self.all_decode else decode.nonzero().flatten()  # [Rd]
        self.other_rows = None if self.all_decode else (~decode).nonzero().flatten()  # [Rp]
        self.source = None  # the KV source whose entries the following layers read
        self._no_entries: torch.Tensor | None = None

    def engram_rows(self, hasher):
        return self.step.engram_rows(hasher)

    def attend(self, attn: Attention, x: torch.Tensor) -> torch.Tensor:
        """x [R, D] (attn_norm output) → [R, D]; CachedStep.attend's maths."""
        step, b, layer = self.step, self.step.b, attn.layer
        angles = rope_angles(b.positions, attn.freqs)  # [R, P]
        q_latent = attn.q_norm(attn.wq_a(x))  # [R, q_lora]
        q = apply_rope(attn.wq_b(q_latent).unflatten(-1, (attn.num_heads, attn.head_dim)), angles)  # [R, H, hd]
        k = step._round("fp8", layer, apply_rope(attn.kv_norm(attn.wkv(x)), angles), b.row_requests, b.positions)
        if self.all_decode:  # every row is its request's last: write them all, read nothing in torch
            step.cache.write_window(layer, step.row_slots, b.ring_slots, k)
            keys = allowed = None
        else:
            keys, allowed = step._window(layer, attn.window, k)  # [R, w, hd], [R, w]; writes the ring
        if attn.ratio:
            if attn.compressor is not None:
                self.source = layer
            step.sparse = step._sparse(attn, x, q_latent, angles)
        out = torch.empty_like(q)  # [R, H, hd], RoPE undone
        rows = self.decode_rows
        if rows is None or rows.numel():
            out_d = self._decode_rows(attn, q, rows)
            if rows is None:
                out = out_d
            else:
                out[rows] = out_d
        if not self.all_decode and self.other_rows.numel():
            out[self.other_rows] = self._torch_rows(attn, q, keys, allowed, angles, self.other_rows)
        grouped = out.reshape(out.shape[0], attn.num_groups, -1)  # [R, G, H/G·hd]
        return attn.wo_b(attn.wo_a(grouped))  # [R, D]

    def _decode_rows(self, attn: Attention, q: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        """Decode rows (all when ``rows`` is None) through the kernel: [Rd, H, hd], RoPE undone."""
        step, b = self.step, self.step.b
        pick = (lambda t: t) if rows is None else (lambda t: t[rows])
        cache = step.cache
        if attn.ratio:
            epb = cache.layout.source(self.source).entries_per_block
            sel = step.sparse.selected[:, 0]  # [R, k] entry ids of the row's request, −1 = none
            selected = entry_slots(pick(sel), b.block_tables[pick(b.row_requests)], epb)
            pool = cache.entries(self.source)[0]
        else:
            selected = torch.empty(q.shape[0] if rows is None else rows.numel(), 0, dtype=torch.int32,
                                   device=q.device)
            pool = self._empty_pool(cache.layout.kv_entry_bytes, q.device)
        return self.kernels.decode_attention.sparse_decode_attention(
            pick(q).contiguous(), cache.ring(attn.layer), pick(step.row_slots), pick(b.positions), attn.window,
            pool, selected, attn.attn_sink, attn.freqs, attn.head_dim**-0.5,
            dot_fp32=self.precision == "fp32" or self.kernels.interpreted)

    def _empty_pool(self, entry_bytes: int, device: torch.device) -> torch.Tensor:
        if self._no_entries is None:
            self._no_entries = torch.zeros(1, 1, entry_bytes, dtype=torch.uint8, device=device)
        return self._no_entries

    def _torch_rows(self, attn: Attention, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor,
                    angles: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """CachedStep.attend's torch attention for ``rows``: [Rp, H, hd], RoPE undone."""
        step, b = self.step, self.step.b
        keys, allowed = keys[rows], allowed[rows]
        if attn.ratio:
            sel = step.sparse.selected[rows, 0]  # [Rp, k]
            width = step.sparse.kv.shape[1]
            flat = step.sparse.kv.flatten(0, 1)  # [N·W, hd]
            picked = flat[(b.row_requests[rows].unsqueeze(-1) * width + sel).clamp_min(0)] if flat.numel() else \
                flat.new_zeros(*sel.shape, attn.head_dim)
            keys = torch.cat((keys, picked.to(keys.dtype)), dim=1)
            allowed = torch.cat((allowed, sel >= 0), dim=1)
        out = sink_attention(q[rows].unsqueeze(1), keys, allowed.unsqueeze(1), attn.attn_sink, attn.head_dim**-0.5)
        return apply_rope(out, angles[rows].unsqueeze(1), inverse=True)[:, 0]
