"""Expert parallelism on two GPUs (NCCL exchange): LLM(data_parallel_size=2, device="cuda") against one
process on the torch backend, the same prompts, greedy. Prints each prompt's tokens from both and the
largest logprob difference over their common prefix, then `bench`-style step times of both.

The torch backend on a GPU has no batch-invariant mode, so the two may differ in the last bits (a row's
matmuls run in other batches); the figures say by how much. The ranks run with async scheduling (a rank's
CUDA default) unless ``--no-async-scheduling``; ``--num-speculative-tokens N`` runs both sides with N DSpark
drafts (greedy: the tokens should not change). Needs at least two CUDA devices:

    python scripts/gpu/ep_check.py
    python scripts/gpu/ep_check.py --no-async-scheduling
    python scripts/gpu/ep_check.py --num-speculative-tokens 3
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false")
    p.add_argument("--num-speculative-tokens", type=int, default=0)
    args = p.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA devices, found {torch.cuda.device_count()}")
        return 2
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams

    prompts = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 37)), [17, 18], [40, 41, 42, 43, 44], [50]]
    params = SamplingParams(temperature=0.0, max_tokens=32)
    engine = dict(
        max_num_seqs=8,
        max_num_batched_tokens=256,
        max_model_len=128,
        block_size=16,
        num_speculative_tokens=args.num_speculative_tokens,
    )
    start = time.perf_counter()
    ranks = LLM("tiny", data_parallel_size=2, device="cuda", async_scheduling=args.async_scheduling, **engine)
    print(
        f"2 ranks up in {time.perf_counter() - start:.1f} s (async scheduling {args.async_scheduling}, "
        f"{args.num_speculative_tokens} drafts)"
    )
    print(f"2 ranks up in {time.perf_counter() - start:.1f} s")
    try:
        start = time.perf_counter()
        two = ranks.generate(prompts, params)
        print(f"dp 2: {time.perf_counter() - start:.2f} s for {len(prompts)} × {params.max_tokens} tokens")
    finally:
        ranks.close()
    one_llm = LLM("tiny", device="cuda", kernel_backend=None, async_scheduling=False, cuda_graphs=False, **engine)
    start = time.perf_counter()
    one = one_llm.generate(prompts, params)
    print(f"dp 1: {time.perf_counter() - start:.2f} s")
    same = 0
    for a, b in zip(two, one):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        diff = max((abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])), default=0.0)
        same += a.token_ids == b.token_ids
        print(f"prompt {a.request_id}: {n}/{len(a.token_ids)} tokens agree, max |Δ logprob| {diff:.3g} over them")
    print(f"{same}/{len(prompts)} prompts give the same tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
