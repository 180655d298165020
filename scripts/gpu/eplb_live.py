"""Live EPLB on two GPUs (NCCL exchange and moves groups): a check for a machine with ≥ 2 GPUs.

    python scripts/gpu/eplb_live.py [--model tiny] [--max-tokens 24] [--device cuda]

(``--device cpu`` runs the same check on two CPU ranks over gloo.)

On one data-parallel group of 2 ranks (cuda:0, cuda:1): generates the prompts once with the start-up layout,
then again with a layout (every layer: experts 1 and 2 to rank 1, 5 and 7 to rank 0) submitted before step
1 on rank 0 and step 3 on rank 1. Exits 1 unless the switch came at one boundary on both ranks, during the
call, and the greedy tokens equal the first run's (batch-invariant mode; the same group, so the same
kernels). Prints the switch log and the seconds of both runs.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _switches(rank) -> tuple[int, list[tuple[int, int]], int]:
    return rank.live.version, list(rank.live.switches), rank.live.num_boundaries


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = p.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs, {torch.cuda.device_count()} visible", file=sys.stderr)
        return 2
    from services.engine.llm import LLM
    from services.engine.sampling_params import SamplingParams
    from services.eplb.layout import Layout

    prompts = [[5, 6, 7, 8], [9, 10, 11], list(range(20, 37)), [17, 18], [40, 41, 42, 43, 44], [50]]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm = LLM(
        args.model,
        data_parallel_size=2,
        device=args.device,
        batch_invariant=True,
        max_num_seqs=4,
        max_model_len=128,
        rank_timeout_s=60.0,
    )
    try:
        cfg = llm.source.config
        if cfg.n_routed_experts != 8:
            print("the layout below is for 8 experts (tiny)", file=sys.stderr)
            return 2
        moved = Layout((7, 0, 3, 5, 6, 1, 2, 4), num_gpus=2, num_logical=8)
        start = time.perf_counter()
        base = [o.token_ids for o in llm.generate(prompts, greedy)]
        t_base = time.perf_counter() - start
        _, _, first = llm.ranks.call(_switches)[0]
        version = llm.ranks.submit_layouts({layer: moved for layer in range(cfg.num_hidden_layers)}, at_step=[1, 3])
        start = time.perf_counter()
        live = [o.token_ids for o in llm.generate(prompts, greedy)]
        t_live = time.perf_counter() - start
        logs = llm.ranks.call(_switches)
    finally:
        llm.close()
    print(f"runs: {t_base:.2f} s start-up layout, {t_live:.2f} s with the live move")
    print(f"switch logs (version, boundary) by rank, boundaries from {first}: {[log for _, log, _ in logs]}")
    ok = True
    if not all(v == version for v, _, _ in logs) or logs[0][1] != logs[1][1]:
        print("FAIL: the ranks did not switch at one boundary", file=sys.stderr)
        ok = False
    elif not first < logs[0][1][-1][1] < logs[0][2] - 1:
        print("FAIL: the switch did not come during the call", file=sys.stderr)
        ok = False
    if live != base:
        print(f"FAIL: tokens changed:\n{base}\n{live}", file=sys.stderr)
        ok = False
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
