"""Generation benchmark: `LLM(model="tiny").generate` tokens per second at a few batch sizes.

Each batch runs random prompts of one length, greedy, with ``ignore_eos`` so every request makes
exactly ``max_tokens`` tokens. One warm-up batch first; the figure is output tokens over the wall
time of ``generate`` (prefill included), and decode-only tokens/s from the decode steps' times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch


def run_batch(llm, batch: int, prompt_len: int, max_tokens: int, seed: int) -> dict:
    from services.engine import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(3, llm.source.config.vocab_size - 1, (prompt_len,), generator=g).tolist() for _ in range(batch)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    engine = llm.engine
    step = engine.step
    started: set[str] = set()
    decode_s = 0.0  # steps after every request had its first token

    def timed_step():
        nonlocal decode_s
        decoding = len(started) == batch
        t0 = time.perf_counter()
        out = step()
        if decoding:
            decode_s += time.perf_counter() - t0
        started.update(o.request_id for o in out if o.token_ids)
        return out

    engine.step = timed_step
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - t0
    finally:
        engine.step = step
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "batch": batch,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "output_tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "decode_tokens_per_s": round((tokens - batch) / decode_s, 1) if decode_s else None,
    }


def main(args: argparse.Namespace) -> int:
    from services.engine import LLM

    torch.set_num_threads(args.threads)
    llm = LLM(model="tiny", block_size=args.block_size, max_num_seqs=max(args.batch))
    if args.runner == "reference":  # the full-recompute runner, for comparison
        from services.worker.runners.reference_runner import ReferenceRunner

        llm.engine.worker.runner = ReferenceRunner(llm.source.model)
    run_batch(llm, 1, args.prompt_len, 4, seed=99)  # warm-up
    results = [run_batch(llm, b, args.prompt_len, args.max_tokens, seed=b) for b in args.batch]
    machine = {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": args.threads,
        "runner": args.runner,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    for r in results:
        print(
            f"batch {r['batch']:>3}: {r['output_tokens']} tokens in {r['wall_s']:.2f} s = "
            f"{r['tokens_per_s']:.1f} tokens/s (decode steps alone {r['decode_tokens_per_s']} tokens/s)"
        )
    print(f"machine: {machine}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"machine": machine, "results": results}, indent=2))
    return 0
