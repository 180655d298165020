"""Run our Triton kernels on CPU tensors under Triton's interpreter, without leaking the setting: the kernel
backend on a machine without a GPU (``--kernels interpreted``, services/worker/kernel_model/interpreted_kernels.py)
and the kernels' CPU tests.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel and again while an interpreted
kernel runs, so it cannot simply be exported for the whole test session: kernels that other test
modules import normally (the GPU tests) must stay compiled. ``load_interpreted`` imports a private
copy of a ``kernels`` module with the variable set; calls to it go inside ``interpreter()``.

Triton's own jit helpers (``tl.max``, ``tl.sum``, ``tl.argmax`` …) are decorated once, when triton is
first imported. This module imports triton normally first, so they are always compiled-kernel
functions (GPU tests in the same process keep working), and ``interpreter()`` swaps interpreted
twins in for the duration of the block.

The interpreter's ``tl.dot`` is ``np.matmul`` in the accumulator's type, i.e. the BLAS's sgemm, whose
micro-kernels (chosen per CPU by OpenBLAS's dynamic arch, and per matrix size) sum K in orders that
depend on M: a row's value then depends on how many rows share its tile, which a GPU's MMA never does.
Inside ``interpreter()`` an fp32 ``tl.dot`` instead rounds the float64 product to fp32 (fp32 operands
multiply exactly in float64; the sum's order moves the float64 result by ~K·2⁻⁵³ relative, which the
rounding to fp32 absorbs): each row's value is its own, on every CPU.

Triton's interpreter swaps its own builtins into ``triton.language`` while a kernel runs and restores them
after, except on a device-function call (``InterpretedFunction.__call__``: a ``@triton.jit`` helper called
from a kernel), whose swap it never undoes. For a helper whose module holds ``triton.language.core`` (every
twin of Triton's stdlib: ``tl.sum``, ``tl.max``, ``tl.cumsum`` …) that leaves ``core.add``, ``core.load``
and the other builtins bound to the interpreter for the rest of the process; ``tensor.__add__`` calls
``core.add``, so a kernel compiled afterwards fails in the code generator ("'block_argument' object has no
attribute 'dtype'") unless Triton's cache already held it. Inside ``interpreter()`` a device-function call
restores what it swapped (``_scoped_device_call``).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType

import numpy as np
import triton  # noqa: F401 - first import without the interpreter: see the module docstring
import triton.language
import triton.runtime.interpreter as triton_interpreter
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

KERNELS = pathlib.Path(__file__).resolve().parent
_TWINS: dict[object, InterpretedFunction] = {}
"""Interpreted twins of Triton's stdlib jit helpers, keyed by the helper's Python function."""


def _stdlib_jit_functions() -> list[tuple[ModuleType, str, JITFunction]]:
    found = []
    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            found += [(module, attr, obj) for attr, obj in vars(module).items() if isinstance(obj, JITFunction)]
    return found


_BLAS_DOT = triton_interpreter.InterpreterBuilder.create_dot


def _row_independent_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """``tl.dot`` with an fp32 accumulator as the fp32 rounding of the float64 product (module docstring);
    fp8 operands go through fp16 as the interpreter's own dot does. Other accumulators: the interpreter's."""
    if d.data.dtype != np.float32:
        return _BLAS_DOT(self, a, b, d, input_precision, max_num_imprecise_acc)
    a_data, b_data = a.data, b.data
    if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():
        a_data = triton_interpreter._convert_float(a_data, a.dtype, triton.language.float16, None).view(np.float16)
    if b.dtype.primitive_bitwidth == 8 and b.dtype.is_floating():
        b_data = triton_interpreter._convert_float(b_data, b.dtype, triton.language.float16, None).view(np.float16)
    product = np.matmul(a_data.astype(np.float64), b_data.astype(np.float64)).astype(np.float32)
    return triton_interpreter.TensorHandle(product + d.data, d.dtype.scalar)


_DEVICE_CALL = InterpretedFunction.__call__


def _scoped_device_call(self, *args, **kwargs):
    """Triton's device-function call, with the builtins it swaps into ``triton.language`` restored after."""
    scope = triton_interpreter._patch_lang(self.fn)  # records the state before the call's own swap
    try:
        return _DEVICE_CALL(self, *args, **kwargs)
    finally:
        scope.restore()


@contextlib.contextmanager
def interpreter() -> Iterator[None]:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    swapped = _stdlib_jit_functions()
    for module, attr, fn in swapped:
        if fn.fn not in _TWINS:
            _TWINS[fn.fn] = InterpretedFunction(fn.fn)
        setattr(module, attr, _TWINS[fn.fn])
    dot, device_call = triton_interpreter.InterpreterBuilder.create_dot, InterpretedFunction.__call__  # nested blocks
    triton_interpreter.InterpreterBuilder.create_dot = _row_independent_dot
    InterpretedFunction.__call__ = _scoped_device_call
    try:
        yield
    finally:
        InterpretedFunction.__call__ = device_call
        triton_interpreter.InterpreterBuilder.create_dot = dot
        for module, attr, fn in swapped:
            setattr(module, attr, fn)
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


SHARED = (
    "rmsnorm",
    "quant_fp8",
    "attention_blocks",
    "prefill_staging",
    "indexer_topk",
    "sampler_select",
    "mhc_streams",
    "moe_layout",
    "fp8_splitk",
    "moe_combine",
    "moe_splitk",
)
"""Modules whose jit helpers other kernels import: their interpreted copies stand in while a kernel loads.
In dependency order: a shared module sees the interpreted copies of those before it only."""


def load_interpreted(name: str) -> ModuleType:
    """A fresh copy of ``kernels.<name>`` whose ``@triton.jit`` kernels (and shared helpers) are interpreted."""
    alias = f"_interpreted_kernels_{name}"
    if alias in sys.modules:
        return sys.modules[alias]
    deps = SHARED[: SHARED.index(name)] if name in SHARED else SHARED
    shared = {f"kernels.{dep}": load_interpreted(dep) for dep in deps}
    spec = importlib.util.spec_from_file_location(alias, KERNELS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    saved = {key: sys.modules.get(key) for key in shared}
    sys.modules.update(shared)
    sys.modules[alias] = module  # registered while it runs, as an import does (dataclasses look it up)
    try:
        with interpreter():
            spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[alias]
        raise
    finally:
        for key, previous in saved.items():
            if previous is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = previous
    sys.modules[alias] = module
    return module
