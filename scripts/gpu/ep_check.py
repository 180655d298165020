"""Expert parallelism on two GPUs (NCCL exchange): LLM(data_parallel_size=2, device="cuda") against one
process, the same prompts, greedy. Prints each prompt's tokens from both and the largest logprob difference over
their common prefix, then step times of both.

``--backend kernels`` (the default, a rank's CUDA default): every rank on the FP8 kernel backend with FP8 experts,
the expert-parallel kernel layer exchanging through fixed-capacity buffers inside the decode graphs
(services/worker/parallel/ep_kernel_moe.py), against one process on the same backend, both in the batch-invariant
mode: the tokens and logprobs should be equal (``==``). ``--backend torch``: the torch MoE on both sides, which has
no batch-invariant mode on a GPU, so the two may differ in the last bits; the figures say by how much. The ranks
run with async scheduling (a rank's CUDA default) unless ``--no-async-scheduling``; ``--num-speculative-tokens N``
runs both sides with N DSpark drafts (greedy: the tokens should not change). Needs at least two CUDA devices:

    python scripts/gpu/ep_check.py
    python scripts/gpu/ep_check.py --backend torch
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
    p.add_argument("--backend", choices=("kernels", "torch"), default="kernels")
    args = p.parse_args()
    kernels = args.backend == "kernels"
    backend = (
        dict(kernel_backend="fp8", expert_format="fp8", batch_invariant=True)
        if kernels
        else dict(kernel_backend=None, cuda_graphs=False)
    )
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
    ranks = LLM(
        "tiny", data_parallel_size=2, device="cuda", async_scheduling=args.async_scheduling, **backend, **engine
    )
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
    one_llm = LLM("tiny", device="cuda", async_scheduling=False, **backend, **engine)
    start = time.perf_counter()
    one = one_llm.generate(prompts, params)
    print(f"dp 1: {time.perf_counter() - start:.2f} s")
    same = 0
    for a, b in zip(two, one):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), len(a.token_ids))
        diff = max((abs(x - y) for x, y in zip(a.logprobs[:n], b.logprobs[:n])), default=0.0)
        same += a.token_ids == b.token_ids
        print(f"prompt {a.request_id}: {n}/{len(a.token_ids)} tokens agree, max |Δ logprob| {diff:.3g} over them")
    equal = sum(a.token_ids == b.token_ids and a.logprobs == b.logprobs for a, b in zip(two, one))
    print(f"{same}/{len(prompts)} prompts give the same tokens, {equal} the same logprobs too ({args.backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
