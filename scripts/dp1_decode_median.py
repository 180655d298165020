"""Issue 23's one-rank check: 150-step decode medians of v41-s1 (kernels, CUDA graphs) at a few batch
sizes and contexts, for whichever tree is first on PYTHONPATH (HEAD, or the pre-EP parent/). Uses only
``step_build.builder`` and ``step_timing.time_decode``, which both trees have, so the same script times
both. Prints one line per size: ``tree ctx batch median_ms p10_ms p90_ms``.

    PYTHONPATH=parent:$site python3 scripts/dp1_decode_median.py --tree parent
"""

from __future__ import annotations

import argparse
import statistics

import torch

from services.bench.step_build import builder, runner_cache
from services.bench.step_timing import time_decode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", required=True, help="label printed on each line")
    parser.add_argument("--model", default="v41-s1")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--contexts", default="4096,32768")
    args = parser.parse_args()
    cuda = args.device == "cuda"  # CPU: the torch backend, a smoke run of the script itself
    build, cfg, _ = builder(args.model, torch.device(args.device), "kernels" if cuda else "torch", args.layers, cuda)
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            llm = build(max_num_seqs=batch, max_model_len=context + args.steps + 16)
            t = time_decode(llm.engine, runner_cache(llm), batch=batch, context=context, steps=args.steps,
                            vocab_size=cfg.vocab_size)
            ms = sorted(s * 1e3 for s in t.seconds)
            p10, p90 = ms[len(ms) // 10], ms[(len(ms) * 9) // 10]
            print(f"{args.tree:>7} ctx {context:>6} batch {batch:>4} median {statistics.median(ms):.3f} ms "
                  f"p10 {p10:.3f} p90 {p90:.3f}", flush=True)
            del llm
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
