"""Run our Triton kernels on CPU tensors under Triton's interpreter, without leaking the setting.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates a kernel and again while an interpreted
kernel runs, so it cannot simply be exported for the whole test session: kernels that other test
modules import normally (the GPU tests) must stay compiled. ``load_interpreted`` imports a private
copy of a ``kernels`` module with the variable set; calls to it go inside ``interpreter()``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pathlib
import sys
from collections.abc import Iterator
from types import ModuleType

KERNELS = pathlib.Path(__file__).resolve().parents[2] / "kernels"


@contextlib.contextmanager
def interpreter() -> Iterator[None]:
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = old


SHARED = ("quant_fp8",)
"""Modules whose jit helpers other kernels import: their interpreted copies stand in while a kernel loads."""


def load_interpreted(name: str) -> ModuleType:
    """A fresh copy of ``kernels.<name>`` whose ``@triton.jit`` kernels (and shared helpers) are interpreted."""
    alias = f"_interpreted_kernels_{name}"
    if alias in sys.modules:
        return sys.modules[alias]
    shared = {f"kernels.{dep}": load_interpreted(dep) for dep in SHARED if dep != name}
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
