"""Batch-invariant launch configurations: the GPU form of the batch-invariant mode (docs/batch-invariance.md).

Inside ``fixed_configs()``, every launcher in ``kernels`` picks its tiles, splits and kernel from the
problem's N, K and head shapes only, never from the number of rows, so a row's result does not depend
on which other rows share the step (or on its place among them):

- FP8 linears: the one-pass grouped GEMM at ``BLOCK_M`` tokens (no split-K at small batches);
- the grouped MoE GEMMs: ``BLOCK_M`` tokens per tile at every load;
- the router: ``ROUTER_SPLITS`` programs over D per token tile at every batch;
- the mHC mix: ``BLOCK_M`` tokens per tile and ``MIX_SPLITS`` programs over D;
- decode attention: one program per row (no flash-decoding splits) and ``ATTENTION_BLOCK_N`` keys per
  block, which is also prefill attention's block, so a decode row gives the same bits through either
  kernel (the window's keys in position order, then the entries, in ``ATTENTION_BLOCK_N`` blocks);
- torch products the backend leaves in torch (bf16/fp32 projections, the head's cuBLAS GEMM, Engram's
  row norms where the kernel set has no ``engram_gate`` kernel, whose programs are per row): ``by_rows``,
  which runs them on fixed ``ROW_CHUNK``-row tiles, zero-padded, so cuBLAS and ATen's reductions see one
  shape whatever the batch.

The choice is a context rather than an argument because it reaches launchers three calls below the
step (the same role ``model/batch_invariant.py``'s context plays for the CPU's torch maths).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

BLOCK_M = 16
"""Tokens per tile of every FP8 GEMM and of the mHC mix in the mode."""
ROUTER_SPLITS = 8
"""Programs over D per router token tile in the mode (split order is fixed: kernels/moe_router.py)."""
MIX_SPLITS = 64
"""Programs over D per mHC mix token tile in the mode."""
ATTENTION_BLOCK_N = 32
"""Keys per block in decode and prefill attention in the mode (both kernels at every head dim)."""
ROW_CHUNK = 64
"""Rows per torch call under ``by_rows``: the shape cuBLAS and ATen see in the mode."""

_depth = 0
Result = TypeVar("Result", torch.Tensor, tuple[torch.Tensor, ...])


def active() -> bool:
    """True inside ``fixed_configs()``."""
    return _depth > 0


@contextlib.contextmanager
def fixed_configs(enabled: bool = True) -> Iterator[None]:
    """Batch-invariant launch choices for the calls inside (nothing when ``enabled`` is False)."""
    global _depth
    if not enabled:
        yield
        return
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1


def by_rows(fn: Callable[..., Result], *rows: torch.Tensor) -> Result:
    """``fn(*rows)`` for a row-wise ``fn`` (row i of each output depends on row i of each input only;
    ``fn`` returns a tensor or a tuple of them).

    Outside the mode: one call. Inside it: calls on ``ROW_CHUNK``-row slices of the inputs (dim 0),
    the last one zero-padded, whose outputs are concatenated and trimmed, so every call has the same
    shape whatever the number of rows."""
    num_rows = rows[0].shape[0]
    if not active() or num_rows == 0:
        return fn(*rows)
    outs = []
    for start in range(0, num_rows, ROW_CHUNK):
        part = [r[start : start + ROW_CHUNK] for r in rows]
        short = ROW_CHUNK - part[0].shape[0]
        if short:
            part = [torch.cat((p, p.new_zeros(short, *p.shape[1:]))) for p in part]
        outs.append(fn(*part))
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(column)[:num_rows] for column in zip(*outs))  # type: ignore[return-value]
    return torch.cat(outs)[:num_rows]
