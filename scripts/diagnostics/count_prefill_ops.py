"""The torch ops, Triton launches and host reads of one eager prefill step on the kernel backend, counted
on CPU (the GPU runs prefill steps eagerly: each op is a Python dispatch and a launch, and each host read
is a stream sync that leaves the device idle while the host issues what follows it).

Counted as in ``count_step_ops.py`` (its ``OpCounter``: non-view aten ops by name and site, interpreted
Triton launches by kernel). Host reads are counted apart, by site: ``Tensor.item`` / ``tolist`` /
``numpy`` / ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__`` calls and the ops whose output
size depends on data (``nonzero``, ``masked_select``, boolean-mask ``index``), each of which is a device →
host read on CUDA. On CPU these cost nothing, so only the count and the site carry over.

The step is the first plan of the tiny oracle case (``--prompts`` tokens per request, one chunk each) on
the kernel backend with FP8 precision (``--precision``), after one untimed step of the same plan shape.

    python3 scripts/diagnostics/count_prefill_ops.py [--prompts 16,16] [--top 30]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts.diagnostics.count_step_ops import OpCounter, _site, print_tables  # noqa: E402

READ_METHODS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
DATA_SIZED = frozenset(
    {
        "aten::nonzero",
        "aten::masked_select",
        "aten::nonzero_static",
        "aten::unique_consecutive",
        "aten::_unique2",
        "aten::repeat_interleave",
    }
)


class ReadCounter(OpCounter):
    """``OpCounter`` plus host reads by site (outside interpreted Triton kernels)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()  # (kind, site) → reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import torch

        name = f"aten::{func.__name__.split('.')[0]}"
        if self.active and not self.inside_triton:
            indices = args[1] if name == "aten::index" and len(args) > 1 else ()
            boolean_index = any(i is not None and i.dtype == torch.bool for i in indices)
            if name in DATA_SIZED or boolean_index:
                self.reads[
                    name + (" (bool mask)" if boolean_index else ""), _site(traceback.extract_stack(limit=40))
                ] += 1
        return super().__torch_dispatch__(func, types, args, kwargs)

    def mark_host_reads(self) -> None:
        """Wrap ``torch.Tensor``'s reading methods (for the whole process): each call inside ``with
        counter`` and outside an interpreted kernel counts once, by site."""
        import torch

        counter = self
        for method in READ_METHODS:
            original = getattr(torch.Tensor, method)

            def counted(self, *args, _original=original, _method=method, **kwargs):
                if counter.active and not counter.inside_triton:
                    counter.reads[f"Tensor.{_method}", _site(traceback.extract_stack(limit=40))] += 1
                return _original(self, *args, **kwargs)

            setattr(torch.Tensor, method, counted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", default="oracle", help="tests/model/deepseek_v41/oracle_configs.py case")
    parser.add_argument("--prompts", default="16,16", help="prompt tokens per request, comma-separated")
    parser.add_argument("--precision", default="fp8", choices=("fp8", "fp32"))
    parser.add_argument("--top", type=int, default=30, help="rows of the by-site tables")
    args = parser.parse_args()

    import torch

    from kernels.interpret import interpreter, load_interpreted
    from scheduler_rs import Scheduler, SchedulerConfig
    from services.engine.config import EngineConfig
    from services.worker.kernel_model.kernel_set import KernelSet
    from services.worker.runners.model_runner import ModelRunner
    from tests.services.worker.runners.test_model_runner import BLOCK, case

    torch.set_num_threads(1)
    prompts = [int(n) for n in args.prompts.split(",")]
    budget, cfg = sum(prompts), case(args.case).model.cfg
    kernels = KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)
    config = EngineConfig(
        block_size=BLOCK,
        num_blocks=64,
        num_state_slots=2 * len(prompts) + 1,
        max_num_seqs=2 * len(prompts),
        max_num_batched_tokens=budget,
        max_model_len=max(prompts) + 8,
    ).worker_config()
    ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
    sched = Scheduler(
        SchedulerConfig(
            block_size=BLOCK,
            num_blocks=64,
            num_state_slots=2 * len(prompts) + 1,
            max_num_seqs=2 * len(prompts),
            max_num_batched_tokens=budget,
            max_model_len=max(prompts) + 8,
            window_size=cfg.sliding_window,
            compress_ratios=ratios,
        )
    )
    gen = torch.Generator().manual_seed(0)
    for warm in (True, False):  # the same plan shape twice: the second is counted
        for i, n in enumerate(prompts):
            sched.add_request(
                f"{'w' if warm else 'r'}{i}",
                torch.randint(3, cfg.vocab_size, (n,), generator=gen).tolist(),
                max_tokens=1,
                ignore_eos=True,
            )
    counter = ReadCounter()
    counter.mark_triton_launches()
    counter.mark_host_reads()
    with interpreter():
        runner = ModelRunner(
            copy.deepcopy(case(args.case).model), config, backend="kernels", precision=args.precision, kernels=kernels
        )
        for warm in (True, False):
            plan = sched.schedule()
            assert plan.is_prefill and plan.seqlens_q.tolist() == prompts, plan.seqlens_q.tolist()
            if warm:
                runner.execute(plan, all_rows=True)
            else:
                with counter:
                    runner.execute(plan, all_rows=True)
    ops, triton, reads = counter.ops, counter.triton, counter.reads
    layers = cfg.num_hidden_layers
    num_ops, num_triton, num_reads = sum(ops.values()), sum(triton.values()), sum(reads.values())
    print(
        f"case {args.case} ({layers} layers), prefill {prompts} tokens, kernel backend {args.precision}: "
        f"{num_ops} torch ops + {num_triton} Triton launches = {num_ops + num_triton} launches, "
        f"{num_reads} host reads per step ({(num_ops + num_triton) / layers:.1f} launches and "
        f"{num_reads / layers:.1f} reads per layer)"
    )
    print("\n| host read | site | per step |\n|---|---|---|")
    for (kind, site), n in reads.most_common(args.top):
        print(f"| {kind} | {site} | {n} |")
    print_tables(ops, triton, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
