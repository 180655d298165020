"""Run our Triton kernels on CPU tensors under Triton's interpreter, without leaking the setting.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel and again while an interpreted
kernel runs, so it cannot simply be exported for the whole test session: kernels that other test
modules import normally (the GPU tests) must stay compiled. ``load_interpreted`` imports a private
copy of a ``kernels`` module with the variable set; calls to it go inside ``interpreter()``.

Triton's own jit helpers (``tl.max``, ``tl.sum``, ``tl.argmax`` …) are decorated once, when triton is
first imported. This module imports triton normally first, so they are always compiled-kernel
functions (GPU tests in the same process keep working), and ``interpreter()`` swaps interpreted
twins in for the duration of the block.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType

import triton  # noqa: F401 - first import without the interpreter: see the module docstring
import triton.language
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"
_TWINS: dict[int, InterpretedFunction] = {}


def _stdlib_jit_functions() -> list[tuple[ModuleType, str, JITFunction]]:
    found = []
    for name, module in list(sys.modules.items()):
        if name == "triton.language" or name.startswith("triton.language."):
            found += [(module, attr, obj) for attr, obj in vars(module).items() if isinstance(obj, JITFunction)]
    return found


@contextlib.contextmanager
def interpreter() -> Iterator[None]:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    swapped = _stdlib_jit_functions()
    for module, attr, fn in swapped:
        setattr(module, attr, _TWINS.setdefault(id(fn), InterpretedFunction(fn.fn)))
    try:
        yield
    finally:
        for module, attr, fn in swapped:
            setattr(module, attr, fn)
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


SHARED = ("rmsnorm", "quant_fp8", "attention_blocks", "indexer_topk", "sampler_select", "mhc_streams", "moe_layout",
          "fp8_splitk", "moe_combine", "moe_splitk")
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
    try:
        with interpreter():
            spec.loader.exec_module(module)
    finally:
        for key, previous in saved.items():
            if previous is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = previous
    sys.modules[alias] = module
    return module
