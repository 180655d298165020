"""kernels/interpret.py: an interpreted kernel leaves ``triton.language`` as it found it, so a kernel
compiled afterwards in the same process goes through Triton's code generator, not the interpreter's builtins."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels.interpret import interpreter, load_interpreted


@triton.jit
def _add_kernel(x_ptr, y_ptr, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(y_ptr + i, tl.load(x_ptr + i) + 1)


def _language_state() -> dict[tuple[str, str], object]:
    """Every attribute of the modules and classes Triton's interpreter swaps builtins into (those that are one
    object on every read: ``__dict__`` and bound class methods are made anew each time)."""
    owners = {
        "tl": tl,
        "core": tl.core,
        "math": tl.math,
        "tensor": tl.tensor,
        "dtype": tl.dtype,
        "descriptor": tl.core.tensor_descriptor_base,
    }
    return {
        (name, attr): getattr(owner, attr)
        for name, owner in owners.items()
        for attr in dir(owner)
        if getattr(owner, attr) is getattr(owner, attr)
    }


def _run_an_interpreted_kernel_with_stdlib_helpers() -> None:
    """moe_contiguous's kernel calls ``tl.sum`` and ``tl.cumsum``: device-function calls of Triton's stdlib."""
    kernel = load_interpreted("moe_contiguous")
    meta = {
        "counts": torch.tensor([1, 0], dtype=torch.int32),
        "row_ids": torch.zeros(2, 2, dtype=torch.int32),
        "route_w": torch.ones(2, 2),
        "slot_of": torch.zeros(2, 1, dtype=torch.long),
    }
    with interpreter():
        kernel.contiguous_layout(torch.ones(2, 128), meta, 4, per_row=True)


def test_an_interpreted_kernel_leaves_triton_language_as_it_found_it():
    before = _language_state()
    _run_an_interpreted_kernel_with_stdlib_helpers()
    after = _language_state()
    changed = sorted(key for key in before if after.get(key) is not before[key])
    assert not changed, f"left swapped: {changed[:10]}"


def test_a_kernel_compiles_for_sm90_after_an_interpreted_run(private_triton_cache):
    _run_an_interpreted_kernel_with_stdlib_helpers()
    source = ASTSource(
        fn=_add_kernel, signature={"x_ptr": "*fp32", "y_ptr": "*fp32", "BLOCK": "constexpr"}, constexprs={(2,): 64}
    )
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert "add.f32" in compiled.asm["ptx"]
    assert any(private_triton_cache.iterdir())  # compiled here, not found in a shared cache
