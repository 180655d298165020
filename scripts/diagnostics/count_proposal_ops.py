"""The torch ops of one static DSpark proposal (the code the draft's CUDA graph captures), counted on CPU by
name and line: ``StaticDraftProposal.run`` from its filled buffers (window read, the draft's stages, the per-slot
loop) for one greedy request of the ``tiny`` preset, 5 drafts, bucket 1.

The counting is ``count_step_ops.py``'s (``OpCounter``): aten ops that move data count once each (views and
allocations do not), Triton kernels run interpreted and count once per launch (the torch ops the interpreter
runs inside them do not). ``--backend kernels`` converts the model with ``convert_model`` (interpreted kernels,
``--precision`` fp8 by default: what the GPU bench's ``--kernel-backend fp8`` runs); ``torch`` is the model as is.

    python3 scripts/diagnostics/count_proposal_ops.py [--backend kernels] [--precision fp8] [--top 40]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from scripts.diagnostics.count_step_ops import OpCounter, _null, print_tables  # noqa: E402

NEXTN = 5


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="preset (default tiny)")
    parser.add_argument("--backend", default="kernels", choices=("kernels", "torch"))
    parser.add_argument("--precision", default="fp8", choices=("fp8", "fp32"))
    parser.add_argument("--spec-sampling", default="rejection", choices=("rejection", "deterministic"))
    parser.add_argument("--anchor-position", type=int, default=40, help="the anchor's position (default 40)")
    parser.add_argument("--top", type=int, default=40, help="rows of the by-site table")
    args = parser.parse_args()

    import torch

    from kernels.interpret import interpreter, load_interpreted
    from services.engine.model_source import load_model
    from services.worker.kernel_model.backend import convert_model
    from services.worker.kernel_model.kernel_set import KernelSet
    from services.worker.sampling.sampler import SamplingRow
    from services.worker.spec.draft_proposal import HostInputs
    from services.worker.spec.static_draft_proposal import ProposalKey, StaticDraftProposal
    from services.worker.state.cache_engine import CacheEngine, ring_size

    torch.set_num_threads(1)
    counter = OpCounter()
    counter.mark_triton_launches()
    model = load_model(args.model, device="cpu").model
    cfg = model.cfg
    kernels = None
    if args.backend == "kernels":
        kernels = KernelSet(*(load_interpreted(name) for name in KernelSet.NAMES), interpreted=True)
        with interpreter():
            convert_model(model, args.precision, kernels)
    cache = CacheEngine(cfg, 16, num_blocks=2, num_state_slots=2, ring=ring_size(cfg, NEXTN), draft=True)
    gen = torch.Generator().manual_seed(0)
    for stage in range(len(model.draft.stages)):
        ring = cache.draft_ring(stage)
        ring.copy_(torch.randn(ring.shape, generator=gen))
    greedy = SamplingRow(0.0, -1, 1.0, 0, 0, None, (), 0, None, ())
    host = HostInputs.pack([greedy], [11], [args.anchor_position], [1], NEXTN, cfg.vocab_size, args.spec_sampling)
    static = StaticDraftProposal(model, cache, ProposalKey.of(host), NEXTN, args.spec_sampling)
    with torch.no_grad(), interpreter() if kernels is not None else _null():
        static.fill(host)
        static.run()  # warm: first-use work is not a replay's
        static.fill(host)
        with counter:
            proposal = static.run()
    ops, triton = counter.ops, counter.triton
    num_ops, num_triton = sum(ops.values()), sum(triton.values())
    print(
        f"{args.model} ({len(model.draft.stages)} draft stages), backend {args.backend}"
        f"{' ' + args.precision if kernels is not None else ''}, {NEXTN} drafts {proposal.drafts.tolist()}: "
        f"{num_ops} torch ops + {num_triton} Triton launches = {num_ops + num_triton} launches per proposal"
    )
    print_tables(ops, triton, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
