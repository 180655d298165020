"""Batch-invariant CPU maths: inside ``batch_invariant()``, every per-row result of the model is
independent of the other rows in the call and of the row's place among them.

Why a mode: a BLAS picks its kernel, blocking and thread split from the whole problem's shape, so row r
of ``F.linear(x, W)`` can differ in its last bits between M = 1 and M = 64 (gemv against gemm, a
K split for small M·N). Those bits then decide FP8/FP4 rounding bins downstream, and a request's
logprobs move by far more than rounding. Inside the mode, a ``TorchFunctionMode`` reroutes the
products the model uses:

- every product (``F.linear``, ``matmul``/``@``, ``mm``, ``addmm``, ``bmm``, two-operand ``einsum``) becomes
  the operands broadcast against each other, multiplied, and summed over the contracted letters
  flattened into one contiguous innermost dim. ATen reduces each output of an innermost-dim sum on its
  own, in an order fixed by the contracted length alone (threads split the outputs, never one output's
  sum: the two-pass split only applies to a single output), so no BLAS heuristic is left to look at M.
  Linear layers go in row chunks that bound the broadcast product's memory.

- transcendental elementwise ops (``exp``, ``sigmoid``, ``silu``, ``softplus``, ``log``, ``tanh``, …) and
  ``addcmul``: ATen runs a vectorised body (SLEEF, fused multiply-adds) and a scalar tail (libm), which
  round differently in the last bit, and which elements fall in the tail depends on the tensor's size
  and on how the threads split it. Inside the mode they run on the flattened tensor in chunks of
  ``_CHUNK`` elements, the last padded to a multiple of 64: every element takes the vectorised path,
  in one thread (a chunk is no larger than ATen's grain size).

What stays the caller's job: the contracted lengths themselves. A sum over a batch-dependent width
(attention keys padded to the batch's longest request) changes its order with the width, so callers
that pad check ``active()`` and pad to a width fixed by the model (``Attention.index_topk``).

Everything else the model runs is elementwise or reduces within one row over a length fixed by the
model (norms, softmax, Sinkhorn, collapse), which ATen computes per row in a fixed order. The guarantee
holds for one process's thread count and CPU capability; it is tested under several of each.
"""

from __future__ import annotations

import contextlib
import math
import string
import threading
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# How many batch_invariant() contexts this thread has open. Per thread, as torch keeps its function modes:
# a thread that never entered the mode runs the plain maths, and must not pad as if it were inside it.
_open = threading.local()


def active() -> bool:
    """True inside ``batch_invariant()`` on this thread."""
    return getattr(_open, "depth", 0) > 0


# Elements of one broadcast product [rows, N, K] in ``rowwise_linear`` (16 MB of fp32): bounds its memory.
_PRODUCT_ELEMENTS = 1 << 22


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K]ᵀ (+ bias) → [..., N], each output an innermost sum of its K products."""
    rows = x.reshape(-1, x.shape[-1])
    step = max(1, _PRODUCT_ELEMENTS // max(1, weight.numel()))
    dtype = torch.promote_types(x.dtype, weight.dtype)
    parts = [
        (rows[i : i + step].unsqueeze(-2) * weight).sum(dim=-1, dtype=dtype) for i in range(0, rows.shape[0], step)
    ]
    out = torch.cat(parts) if parts else rows.new_zeros(0, weight.shape[0], dtype=dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def summed_einsum(equation: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two-operand einsum as broadcast product + one innermost sum over the contracted letters."""
    inputs, output = equation.replace(" ", "").split("->")
    left, right = inputs.split(",")
    if "." in equation or len(set(left)) != len(left) or len(set(right)) != len(right):
        raise ValueError(f"batch-invariant einsum takes explicit, non-repeated letters, got {equation!r}")
    contracted = [c for c in dict.fromkeys(left + right) if c not in output]
    order = list(output) + contracted
    sizes = {c: n for c, n in zip(left + right, (*a.shape, *b.shape))}

    def spread(t: torch.Tensor, letters: str) -> torch.Tensor:
        t = t.permute(*[letters.index(c) for c in order if c in letters])
        shape = [sizes[c] if c in letters else 1 for c in order]
        return t.reshape(shape)

    product = spread(a, left) * spread(b, right)  # [output letters..., contracted letters...], contiguous
    product = product.reshape(*[sizes[c] for c in output], math.prod(sizes[c] for c in contracted))
    return product.sum(dim=-1)


def _batched_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (broadcast batch dims) through ``summed_einsum``."""
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = a.expand(*batch, *a.shape[-2:])
    b = b.expand(*batch, *b.shape[-2:])
    letters = string.ascii_lowercase[: len(batch)]  # batch letters a, b, …; x, y, z are M, K, N
    return summed_einsum(f"{letters}xy,{letters}yz->{letters}xz", a, b)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if b.dim() == 1:
        return _matmul(a, b.unsqueeze(-1)).squeeze(-1)
    if a.dim() == 1:
        return _matmul(a.unsqueeze(0), b).squeeze(-2)
    if b.dim() == 2:
        return rowwise_linear(a, b.t())
    return _batched_matmul(a, b)


# Elements per call of a chunked elementwise op: ATen's grain size, so one thread runs it; a multiple of
# 64, so every vector width's body covers it with no scalar tail.
_CHUNK = 32768
_ELEMENTWISE = {
    torch.exp,
    torch.Tensor.exp,
    torch.exp2,
    torch.Tensor.exp2,
    torch.expm1,
    torch.Tensor.expm1,
    torch.log,
    torch.Tensor.log,
    torch.log2,
    torch.Tensor.log2,
    torch.log1p,
    torch.Tensor.log1p,
    torch.sigmoid,
    torch.Tensor.sigmoid,
    torch.tanh,
    torch.Tensor.tanh,
    torch.erf,
    torch.Tensor.erf,
    F.silu,
    F.softplus,
    F.gelu,
    torch.addcmul,
    torch.Tensor.addcmul,
}


def chunked_elementwise(func, *args, **kwargs):
    """``func`` over its tensor arguments broadcast together, flattened and run in padded chunks."""
    tensors = [a for a in args if torch.is_tensor(a)]
    shape = torch.broadcast_shapes(*(t.shape for t in tensors))
    flat = [a.expand(shape).reshape(-1) if torch.is_tensor(a) else a for a in args]
    numel = shape.numel()
    out = []
    for start in range(0, numel, _CHUNK):
        stop = min(start + _CHUNK, numel)
        pad = -(stop - start) % 64
        parts = [F.pad(a[start:stop], (0, pad)) if torch.is_tensor(a) else a for a in flat]
        out.append(func(*parts, **kwargs)[: stop - start])
    if not out:
        return func(*args, **kwargs)
    return torch.cat(out).reshape(shape)


def _einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
        operands = tuple(operands[0])
    if len(operands) == 1:
        return torch.einsum(equation, operands[0])  # one operand: no product across rows
    if len(operands) > 2:
        raise NotImplementedError("batch-invariant einsum takes at most two operands")
    return summed_einsum(equation, *operands)


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return bias + _matmul(a, b)


def _in_place(func):
    def run(self: torch.Tensor, *args, **kwargs):
        return self.copy_(chunked_elementwise(func, self, *args, **kwargs))

    return run


# func → its batch-invariant form; these take no keyword arguments (out=, out_dtype= would bypass them).
_PRODUCTS = {
    F.linear: rowwise_linear,
    torch.matmul: _matmul,
    torch.Tensor.matmul: _matmul,
    torch.Tensor.__matmul__: _matmul,
    torch.Tensor.__rmatmul__: lambda a, b: _matmul(b, a),
    torch.mm: _matmul,
    torch.Tensor.mm: _matmul,
    torch.bmm: _matmul,
    torch.Tensor.bmm: _matmul,
    torch.addmm: _addmm,
    torch.Tensor.addmm: _addmm,
    torch.einsum: _einsum,
}
_IN_PLACE = {
    torch.Tensor.exp_: torch.exp,
    torch.Tensor.sigmoid_: torch.sigmoid,
    torch.Tensor.log_: torch.log,
    torch.Tensor.tanh_: torch.tanh,
    torch.Tensor.addcmul_: torch.addcmul,
}


class _Mode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _PRODUCTS:
            if kwargs and set(kwargs) != {"bias"}:
                raise NotImplementedError(
                    f"batch-invariant {func.__name__} takes no keyword arguments {sorted(kwargs)}"
                )
            return _PRODUCTS[func](*args, **kwargs)
        if func in _ELEMENTWISE:
            if kwargs.get("inplace", False) or "out" in kwargs:
                raise NotImplementedError(f"batch-invariant {func.__name__} runs out of place only")
            return chunked_elementwise(func, *args, **kwargs)
        if func in _IN_PLACE:
            return _in_place(_IN_PLACE[func])(*args, **kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Runs the block with batch-invariant products (module docstring); a no-op when not ``enabled``."""
    if not enabled:
        yield
        return
    _open.depth = getattr(_open, "depth", 0) + 1
    try:
        with _Mode():
            yield
    finally:
        _open.depth -= 1
