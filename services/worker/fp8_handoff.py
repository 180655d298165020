"""Activations quantised where they are made, for the FP8 projections that read them next.

A norm that feeds FP8 projections (a block's ``attn_norm`` → attention's ``wq_a`` and ``wkv``;
attention's ``q_norm`` → ``wq_b`` and the indexer's ``wq_b``) runs ``kernels.rmsnorm.rmsnorm_quant``
(services/worker/quantizing_norm.py): its output y and ``quantize_act`` of y come from one launch and
are left here under the norm's site name. A ``KernelLinear`` whose input is that y takes the stored
quantisation instead of launching its own: per layer, a norm and three quantisers become one launch.

The model's code between the two (model/deepseek_v41/block.py, services/worker/attention_step.py)
passes plain tensors, so an input is matched to a stored y by its memory: the same device, dtype,
data pointer, element count and last dim, contiguous, and y's version counter unchanged (views share
it; any in-place write to y since would have moved it). A stored y is held alive, so no other live
tensor can start at its address unless it views y's memory, and then it holds y's values: a match
is always y's rows, and the stored quantisation is exactly what ``quantize_act`` would give.

One slot per site, overwritten by the next layer's norm at that site: at most one y per site is kept
alive (two layers' activations at decode's sizes; the norm hands nothing over above
``MAX_ROWS`` rows, where it would pin prefill's activations between steps).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_ROWS = 1024
"""The most rows a norm hands over: every decode size (``fp8_linear.META_CACHE_MAX_TOKENS``)."""


@dataclass(frozen=True)
class QuantizedRows:
    """A norm's output and its FP8 activation quantisation."""

    rows: torch.Tensor  # [T, C] the norm's output, contiguous, as the norm returned it (viewed)
    version: int  # rows._version when stored: unchanged while nothing wrote to rows in place
    q: torch.Tensor  # e4m3 [T, C'] quantize_act(rows zero-padded to C' = C rounded up to 128)
    scale: torch.Tensor  # fp32 [T, C'/128] its power-of-two scales


class Fp8Handoff:
    """The slots one converted model's quantizing norms and FP8 linears share (see the module docstring)."""

    def __init__(self) -> None:
        self._slots: dict[str, QuantizedRows] = {}

    def put(self, site: str, rows: torch.Tensor, a: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Stores rows [T, C] (contiguous) with a = (q, scale) = quantize_act of rows padded to 128."""
        self._slots[site] = QuantizedRows(rows, rows._version, *a)

    def drop(self, site: str) -> None:
        self._slots.pop(site, None)

    def take(self, x: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [T, width], scale) stored for a norm output that x [..., C] is (see the module docstring), or
        None: the caller quantises x itself."""
        for slot in self._slots.values():
            y = slot.rows
            if (x.data_ptr() == y.data_ptr() and x.device == y.device and x.dtype == y.dtype
                    and x.numel() == y.numel() and x.shape[-1] == y.shape[-1] and x.is_contiguous()
                    and x._version == slot.version == y._version and slot.q.shape[-1] == width):
                return slot.q, slot.scale
        return None
