"""Count the specialisations Triton would compile for the launches of a block of code, on CPU or GPU.

A compiled kernel's cache key (``triton/runtime/jit.py``: ``JITFunction.run`` → ``create_function_from_signature``
→ ``compute_cache_key``) is the list of each argument's specialisation plus the launch options: a constexpr's
value; a tensor's element type and whether its address is 16-byte aligned ("D"); an int's type (i32/i64) and
whether it is divisible by 16 ("D") or equal to 1 (then a constexpr 1); bools and floats by type only; for an
argument in ``do_not_specialize`` its type only. Under Triton's interpreter (``kernels/interpret.py``)
nothing is compiled, so counting compiles there proves nothing; ``SpecKeys`` instead computes that key for every
launch with Triton's own binder (``create_function_from_signature`` over the kernel's ``KernelParam``s and
``native_specialize_impl``), so a CPU test sees exactly the variants a GPU would compile.

``with SpecKeys() as keys:`` records every launch of an interpreted kernel (``InterpretedFunction.run``) and of a
compiled one (``JITFunction.run``) in the block; ``keys.seen`` maps kernel name → its set of keys, and
``keys.new_since(earlier)`` names the keys not in an earlier snapshot.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

from triton.backends.compiler import BaseBackend
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITCallable, JITFunction, KernelParam, create_function_from_signature

_BINDERS: dict[object, tuple[str, object]] = {}
"""Per kernel's Python function: its name and Triton's binder of (args, kwargs) → specialisation."""


def kernel_name(fn) -> str:
    """``module.qualname`` with an interpreted copy's module (``_interpreted_kernels_X``) named as ``kernels.X``."""
    module = fn.__module__.replace("_interpreted_kernels_", "kernels.")
    return f"{module}.{fn.__qualname__}"


def _binder(fn, options: dict) -> tuple[str, object]:
    if fn not in _BINDERS:
        dns = options.get("do_not_specialize") or ()
        dns_oa = options.get("do_not_specialize_on_alignment") or ()
        signature = inspect.signature(fn)
        params = [
            KernelParam(i, p, i in dns or p.name in dns, i in dns_oa or p.name in dns_oa)
            for i, p in enumerate(signature.parameters.values())
        ]
        _BINDERS[fn] = kernel_name(fn), create_function_from_signature(signature, params, BaseBackend)
    return _BINDERS[fn]


def _plain(value):
    """A specialisation entry with jit helpers (passed as constexprs) named, as ``compute_cache_key`` hashes them."""
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, (JITCallable, InterpretedFunction)):
        return kernel_name(value.fn)
    return value


def spec_key(fn, decorator_options: dict, args: tuple, kwargs: dict) -> tuple[str, tuple]:
    """(kernel name, key): the key Triton compiles ``fn`` under for this launch (module docstring)."""
    name, binder = _binder(fn, decorator_options)
    _, specialization, options = binder(*args, **kwargs)
    return name, (_plain(specialization), tuple(sorted((k, repr(v)) for k, v in options.items())))


class SpecKeys:
    """Records every kernel launch's specialisation key inside ``with`` (module docstring)."""

    def __init__(self) -> None:
        self.seen: dict[str, set[tuple]] = defaultdict(set)
        self.num_launches = 0
        self._saved: list[tuple[type, object]] = []

    def add(self, fn, decorator_options: dict, args: tuple, kwargs: dict) -> None:
        name, key = spec_key(fn, decorator_options, args, kwargs)
        self.seen[name].add(key)
        self.num_launches += 1

    def snapshot(self) -> dict[str, frozenset[tuple]]:
        return {name: frozenset(keys) for name, keys in self.seen.items()}

    def new_since(self, earlier: dict[str, frozenset[tuple]]) -> dict[str, list[tuple]]:
        """Per kernel, the keys seen now that ``earlier`` had not."""
        return {
            name: sorted(keys - earlier.get(name, frozenset()), key=repr)
            for name, keys in self.seen.items()
            if keys - earlier.get(name, frozenset())
        }

    def counts(self) -> dict[str, int]:
        return {name: len(keys) for name, keys in sorted(self.seen.items())}

    def __enter__(self) -> SpecKeys:
        recorder = self
        interpreted_run, jit_run = InterpretedFunction.run, JITFunction.run

        def run_interpreted(self, *args, grid, warmup, **kwargs):
            recorder.add(self.fn, self.kwargs, args, kwargs)
            return interpreted_run(self, *args, grid=grid, warmup=warmup, **kwargs)

        def run_jit(self, *args, grid, warmup, **kwargs):
            options = {
                "do_not_specialize": self.do_not_specialize,
                "do_not_specialize_on_alignment": self.do_not_specialize_on_alignment,
            }
            recorder.add(self.fn, options, args, kwargs)
            return jit_run(self, *args, grid=grid, warmup=warmup, **kwargs)

        self._saved = [(InterpretedFunction, interpreted_run), (JITFunction, jit_run)]
        InterpretedFunction.run, JITFunction.run = run_interpreted, run_jit
        return self

    def __exit__(self, *exc) -> None:
        for cls, run in self._saved:
            cls.run = run
        self._saved = []
