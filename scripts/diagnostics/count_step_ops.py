"""The torch ops of one static decode step (the code a CUDA graph captures), counted on CPU by name and line.

Each aten op that reaches the dispatcher (a ``TorchDispatchMode``: after autograd and the implicit
decompositions) and moves data (elementwise, index, fill, copy, cat, arange, GEMMs...) is one kernel
launch on CUDA; views (view, unsqueeze, expand, slice, ...) and allocations (empty) launch nothing and are
not counted. ``scalar_tensor`` (a Python scalar operand wrapped on the host) is counted though it
launches nothing on CUDA. Triton kernels run interpreted here: their launches are counted by kernel name,
and the torch ops the interpreter runs inside them are not (on the GPU each is one launch). The tiny
case's dims are not multiples of 128, so its ``pad_last`` / ``_blocks`` pads (``constant_pad_nd``) have
no counterpart at v41-s1's dims.

The step is the tiny test case's first decode plan (5 rows padded to graph size 8) on the kernel backend
("kernels": FP8 linears, KernelMoE, the kernel head and mHC) with ``attention="triton"`` (the GPU step's
code), or ``--attention reference`` (the static torch ops).

    python3 scripts/diagnostics/count_step_ops.py [--case oracle] [--attention triton] [--top 40]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import traceback

from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

# Aten ops that launch nothing on CUDA: views, metadata and allocations.
NO_LAUNCH = frozenset(
    """
aten::view aten::_unsafe_view aten::unsqueeze aten::squeeze aten::expand aten::slice aten::select aten::as_strided
aten::t aten::transpose aten::permute aten::view_as_complex aten::view_as_real aten::unflatten aten::flatten
aten::reshape aten::_reshape_alias aten::alias aten::detach aten::detach_ aten::lift_fresh aten::empty
aten::empty_strided aten::empty_like aten::resize_ aten::unbind aten::split aten::chunk aten::narrow
aten::conj aten::_conj aten::resolve_conj aten::resolve_neg aten::result_type aten::is_nonzero
aten::_has_compatible_shallow_copy_type aten::set_ aten::numpy_T aten::movedim aten::diagonal
aten::_unsafe_split aten::split_with_sizes aten::expand_as aten::view_as aten::contiguous aten::to
aten::type_as aten::broadcast_tensors aten::_nested_tensor_from_mask_left_aligned aten::item
aten::_local_scalar_dense aten::is_same_size aten::dim aten::size aten::stride
""".split()
)
ROOTS = ("model/", "services/", "kernels/")  # the repository's code: where an op is attributed


def _site(stack: traceback.StackSummary) -> str:
    """The innermost frame in the repository's code (services/, model/, kernels/): 'path:line func'."""
    for frame in reversed(stack):
        name = frame.filename.replace(os.sep, "/")
        for root in ROOTS:
            at = name.rfind("/" + root)
            if at >= 0 and "/site-packages/" not in name and "/tests/" not in name:
                return f"{name[at + 1 :]}:{frame.lineno} {frame.name}"
    return "?"


class OpCounter(TorchDispatchMode):
    """Every aten op that reaches a kernel (after autograd and the implicit decompositions), by name and
    site, outside the interpreted Triton kernels; and the Triton launches by kernel name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()  # (op, site) → launches
        self.triton: collections.Counter = collections.Counter()  # kernel → launches
        self.inside_triton = 0  # > 0 while an interpreted kernel runs
        self.active = False  # inside ``with counter``: launches outside it (a warm-up run) are not counted

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc):
        self.active = False
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = f"aten::{func.__name__.split('.')[0]}"
        if not self.inside_triton and name not in NO_LAUNCH:
            self.ops[name, _site(traceback.extract_stack(limit=40))] += 1
        return func(*args, **(kwargs or {}))

    def mark_triton_launches(self) -> None:
        """Wrap the interpreter's launch (for the whole process): each one inside ``with counter`` counts
        once, and the ops inside it none."""
        from triton.runtime.interpreter import InterpretedFunction

        run, counter = InterpretedFunction.run, self

        def counted(self, *args, **kwargs):
            counter.triton[self.fn.__name__] += counter.active and not counter.inside_triton
            counter.inside_triton += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                counter.inside_triton -= 1

        InterpretedFunction.run = counted


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="oracle", help="tests/model/deepseek_v41/oracle_configs.py case")
    parser.add_argument("--attention", default="triton", choices=("triton", "reference"))
    parser.add_argument("--backend", default="kernels", choices=("kernels", "torch"))
    parser.add_argument("--top", type=int, default=40, help="rows of the by-site table")
    parser.add_argument("--invariant", action="store_true", help="in the batch-invariant mode")
    args = parser.parse_args()

    import torch

    from kernels.interpret import interpreter, load_interpreted
    from model.batch_invariant import batch_invariant
    from services.engine.config import EngineConfig
    from services.worker.kernel_model.kernel_set import KernelSet
    from services.worker.runners.decode_step_graphs import DecodeStepGraphs
    from services.worker.runners.model_runner import ModelRunner
    from tests.services.worker.runners.test_model_runner import case
    from tests.services.worker.runners.test_static_decode_step import BLOCK, MAX_LEN, _decode_plan

    torch.set_num_threads(1)
    counter = OpCounter()
    counter.mark_triton_launches()
    plan, torch_runner = _decode_plan(args.case)
    kernels = KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)
    model = copy.deepcopy(case(args.case).model)
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=torch_runner.cache.blocks.shape[0],
        num_state_slots=torch_runner.cache.slots.shape[0],
        max_num_seqs=8,
        max_model_len=MAX_LEN,
    ).worker_config()
    backend = "kernels" if args.backend == "kernels" else None
    with interpreter(), batch_invariant() if args.invariant else _null():
        runner = ModelRunner(model, config, backend=backend, kernels=kernels if backend else None)
        static = DecodeStepGraphs(
            runner,
            config,
            use_graphs=False,
            attention=args.attention,
            kernels=kernels if args.attention == "triton" else None,
        )
        runner.cache.blocks.copy_(torch_runner.cache.blocks)
        runner.cache.slots.copy_(torch_runner.cache.slots)
        step = static.step(plan.graph_size)
        step.fill(plan)
        step.run()  # warm: first-use work (lazy buffers) is not a replay's
        runner.cache.blocks.copy_(torch_runner.cache.blocks)
        runner.cache.slots.copy_(torch_runner.cache.slots)
        step.fill(plan)
        with counter:
            step.run()
    ops, triton = counter.ops, counter.triton
    layers = model.cfg.num_hidden_layers
    print(
        f"case {args.case} ({layers} layers), backend {args.backend}, attention {args.attention}, "
        f"graph size {plan.graph_size}: {sum(ops.values())} torch ops + {sum(triton.values())} Triton launches "
        f"= {sum(ops.values()) + sum(triton.values())} launches per step"
    )
    print_tables(ops, triton, args.top)
    return 0


def print_tables(ops: collections.Counter, triton: collections.Counter, top: int) -> None:
    """Markdown tables of counted launches: torch ops by name, Triton kernels, then the ``top`` torch ops by site
    and by function."""
    by_name: collections.Counter = collections.Counter()
    for (name, _), n in ops.items():
        by_name[name] += n
    print("\n| torch op | launches |\n|---|---|")
    for name, n in by_name.most_common():
        print(f"| {name} | {n} |")
    print("\n| Triton kernel | launches |\n|---|---|")
    for name, n in triton.most_common():
        print(f"| {name} | {n} |")
    print("\n| torch op | site | launches |\n|---|---|---|")
    for (name, site), n in ops.most_common(top):
        print(f"| {name} | {site} | {n} |")
    print("\n| function (every op and line in it) | torch ops |\n|---|---|")
    for function, n in _by_function(ops).most_common(top):
        print(f"| {function} | {n} |")


def _by_function(by_site: collections.Counter) -> collections.Counter:
    """The by-site counts summed per innermost repository function ('path func'): where to look first."""
    out: collections.Counter = collections.Counter()
    for (_, site), n in by_site.items():
        path_line, _, func = site.partition(" ")
        out[f"{path_line.rsplit(':', 1)[0]} {func}".strip()] += n
    return out


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    raise SystemExit(main())
