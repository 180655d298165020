"""One-rank step medians of a source tree: 150-step decode medians of v41-s1 (kernels, CUDA graphs) at a
few batch sizes and contexts, and medians of repeated whole-prompt prefill steps (the bench's single
prefill sample moved by ±25% run to run), for whichever tree is first on PYTHONPATH (the checkout, or a
baseline tree such as base/). Uses only
``step_build.builder`` and ``step_timing.time_decode``, which both trees have, so the same script times
both. Prints one line per size: ``tree ctx batch median_ms p10_ms p90_ms`` (``prefill tokens ...``).

    PYTHONPATH=base:$site python3 scripts/gpu/decode_median.py --tree base    # the ``compare`` suite
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

from services.bench.step.build import builder, runner_cache
from services.bench.step.timing import time_decode, time_prompt_step


def _line(tree: str, label: str, seconds: list[float]) -> str:
    ms = sorted(s * 1e3 for s in seconds)
    p10, p90 = ms[len(ms) // 10], ms[(len(ms) * 9) // 10]
    return f"{tree:>7} {label} median {statistics.median(ms):.3f} ms p10 {p10:.3f} p90 {p90:.3f}"


def _collect() -> None:
    """A dropped engine's pools and graphs freed now (it holds reference cycles), not by a collection that
    would land inside the next build's timed steps."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", required=True, help="label printed on each line")
    parser.add_argument("--model", default="v41-s1")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--prefill-tokens", default="1024,4096", help="'' for none")
    parser.add_argument("--prefill-repeats", type=int, default=10)
    args = parser.parse_args()
    cuda = args.device == "cuda"  # CPU: the torch backend, a smoke run of the script itself
    build, cfg, _ = builder(args.model, torch.device(args.device), "kernels" if cuda else "torch", args.layers, cuda)
    for tokens in [int(t) for t in args.prefill_tokens.split(",") if t]:
        llm = build(max_num_seqs=1, max_model_len=tokens + 8, max_num_batched_tokens=tokens)
        device = runner_cache(llm).blocks.device
        seconds = [time_prompt_step(llm.engine, device, tokens, cfg.vocab_size) for _ in range(args.prefill_repeats)]
        print(_line(args.tree, f"prefill {tokens:>6} tokens", seconds), flush=True)
        del llm
        _collect()
    for context in [int(c) for c in args.contexts.split(",") if c]:
        for batch in [int(b) for b in args.batches.split(",") if b]:
            llm = build(max_num_seqs=batch, max_model_len=context + args.steps + 16)
            t = time_decode(
                llm.engine, runner_cache(llm), batch=batch, context=context, steps=args.steps, vocab_size=cfg.vocab_size
            )
            print(_line(args.tree, f"ctx {context:>6} batch {batch:>4}", t.seconds), flush=True)
            del llm
            _collect()


if __name__ == "__main__":
    main()
