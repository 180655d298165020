"""What ``AttentionStep`` (services/worker/attention/step.py) asks of a backend: the three parts of a
layer's attention that have kernels (compress, index-select, attend), and the rounding hook they share.

Backends: ``TorchAttention`` (attention_backend_torch.py: any rows, the model's own functions, the CPU
path and the oracle), ``TritonAttention`` (attention_backend_triton.py: any rows, the Triton kernels
reading the packed pools) and ``GraphAttention`` (attention_backend_graph.py: the static decode rows a
CUDA graph captures, on static torch ops or the kernels). A backend is made for one step (or, for the
graph form, one static row count) and holds what the layers' KV and index sources published in it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from model.deepseek_v41.attention import Attention

# (kind, layer, pre-rounding values [n, ...], request id per value row, position or entry per row) → values.
# Kinds: "fp8" window K, "kv4" compressed entries, "idx4k" index keys, "idx4q" index queries.
Rounding = Callable[[str, int, torch.Tensor, list[str], torch.Tensor], torch.Tensor]


class StepRounding:
    """A ``Rounding`` hook bound to one step's request ids (tests, tracing: the oracle harness replays the
    reference's decision at values within FLIP_BOUNDARY_TOL of a bin edge); the identity without one."""

    def __init__(self, hook: Rounding | None = None, request_ids: list[str] | None = None) -> None:
        self.hook = hook  # None: every value passes unchanged
        self.request_ids = request_ids or []  # the step's requests, in the plan's order

    @property
    def active(self) -> bool:
        return self.hook is not None

    def __call__(
        self, kind: str, layer: int, x: torch.Tensor, requests: torch.Tensor, index: torch.Tensor
    ) -> torch.Tensor:
        """x [n, ...] pre-rounding values; requests [n] indices into the step's requests; index [n]."""
        if self.hook is None:
            return x
        return self.hook(kind, layer, x, [self.request_ids[i] for i in requests.tolist()], index)


class AttentionBackend(Protocol):
    """Compress, index-select and attend over the paged caches for one step's rows (R of them)."""

    undoes_rope: bool
    """``attend``'s output has RoPE undone (the kernels' contract); False: the step undoes it in the output
    projection (the model's ``Attention.project_out``)."""

    def compress(self, attn: Attention, x: torch.Tensor) -> None:
        """A KV source layer (spec §3.4, §3.6): this step's complete groups of x [R, D] (attn_norm output)
        into the layer's pool, partial groups into the state slots; the layer becomes the source the
        following compressed layers read."""

    def select(self, attn: Attention, x: torch.Tensor, q_latent: torch.Tensor, angles: torch.Tensor) -> None:
        """A compressed layer: checks that a KV source of its ratio precedes it; an index source then
        picks each row's entries (ascending, −1 = none; candidates as the layer's role says), any other
        layer keeps the nearest index source's selection. q_latent [R, q_lora], angles [R, P]."""

    def attend(self, attn: Attention, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """q [R, H, hd] and k [R, hd] (RoPE applied; k before its FP8 rounding): writes each request's
        last rows' K to its window ring and attends each row over its window and its selected entries,
        with the sink → [R, H, hd] (RoPE undone iff ``undoes_rope``)."""
