"""The launches of one expert-parallel MoE layer at world size 1 against ``KernelMoE``'s, counted on CPU.

One rank (``VirtualPeerExchange(1)``: each all-to-all one device copy, as NCCL's at world size 1 is one launch)
runs ``ep_layer`` on the tiny preset's layer with ``--tokens`` live tokens; the unsharded ``KernelMoE`` runs the
same tokens. Launches are counted as scripts/diagnostics/count_step_ops.py counts them (its ``OpCounter``: aten
ops that move data, plus the interpreted Triton kernels by name); a warm-up call first. The tiny preset's dims are
not multiples of 128, so both sides count ``pad_last``'s pads, which v41-s1's dims do not have.

    python3 scripts/diagnostics/count_ep_ops.py [--tokens 8] [--expert-format fp4] [--top 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--expert-format", default="fp4", choices=("fp4", "fp8"))
    parser.add_argument("--top", type=int, default=40, help="rows of the by-site table")
    args = parser.parse_args()

    import torch

    from kernels.interpret import interpreter, load_interpreted
    from model.deepseek_v41.moe import MoE
    from model.deepseek_v41.presets import TINY
    from scripts.diagnostics.count_step_ops import OpCounter, print_tables
    from services.worker.kernel_model.kernel_set import KernelSet
    from services.worker.kernel_model.moe import KernelMoE
    from services.worker.parallel.ep_kernel_moe import ExpertParallelKernelMoE, ep_layer
    from services.worker.parallel.ep_moe import ExpertParallel
    from services.worker.parallel.expert_slots import ExpertSlots
    from services.worker.parallel.peer_exchange import VirtualPeerExchange

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = dataclasses.replace(TINY, swiglu_limit=10.0)
    moe = MoE(cfg)
    kernels = KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)
    slots = ExpertSlots.startup(cfg.n_routed_experts, 1, 0, 0)
    parallel = ExpertParallel(None, [slots], peer=VirtualPeerExchange(1), pass_tokens=args.tokens)  # type: ignore[arg-type]
    layer = ExpertParallelKernelMoE(KernelMoE(moe, "fp8", kernels, args.expert_format), 0, parallel)
    plain = KernelMoE(moe, "fp8", kernels, args.expert_format)
    x = torch.randn(1, args.tokens, cfg.hidden_size)
    counts = torch.zeros(cfg.n_routed_experts, dtype=torch.long)
    results = {}
    for name, run in (
        ("KernelMoE", lambda: plain(x, counts)),
        ("ExpertParallelKernelMoE", lambda: ep_layer([layer], [x], [counts], [None], [None])),
    ):
        counter = OpCounter()
        counter.mark_triton_launches()
        with torch.no_grad(), interpreter():
            run()  # warm: the exchange's buffers are made on first use
            with counter:
                run()
        results[name] = counter
        ops, triton = counter.ops, counter.triton
        print(
            f"\n## {name}, {args.tokens} tokens, experts {args.expert_format}: {sum(ops.values())} torch ops + "
            f"{sum(triton.values())} Triton launches = {sum(ops.values()) + sum(triton.values())} launches per layer"
        )
        print_tables(ops, triton, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
