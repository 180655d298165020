"""The walkthrough's batch-invariance test with ``==`` on a GPU model (the ``invariance`` suite).

The prompts run as one batch (temperature 1.0, top-p 0.7, ``--max-tokens`` tokens, 5 top logprobs, a seed
each), then each prompt alone, forced to the batch's tokens under another seed. Token ids, logprobs, top
ids and top logprobs must be equal under Python ``==``. The engine is ``LLM``'s CUDA default (FP8
kernels, CUDA graphs, async scheduling) with ``batch_invariant=True``. Prints one JSON line.

    python3 scripts/gpu/batch_invariance.py --model v41-s1 --load-format dummy --num-prompts 64
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="v41-s1")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=50)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument(
        "--profile-alone",
        type=int,
        default=0,
        metavar="N",
        help="profile the first N alone runs (cProfile, top functions by own time to stderr)",
    )
    p.add_argument(
        "--log-compiles",
        action="store_true",
        help="print every Triton compile (kernel, constexprs, argument specialisation) to stderr",
    )
    args = p.parse_args()

    import torch

    if args.log_compiles:
        from triton import knobs

        def log_compile(*, repr: str, **_: object) -> None:  # Triton calls it before compiling; None: compile
            print(f"compile {repr}", file=sys.stderr, flush=True)

        knobs.runtime.jit_cache_hook = log_compile

    from services.engine import LLM, SamplingParams

    lengths = [16 + 13 * k for k in range(args.num_prompts)]  # 16 … 835 tokens at 64 prompts
    prompts = [
        torch.randint(3, 120_000, (n,), generator=torch.Generator().manual_seed(k)).tolist()
        for k, n in enumerate(lengths)
    ]
    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format=args.load_format,
        batch_invariant=True,
        max_num_seqs=args.num_prompts,
        max_model_len=max(lengths) + args.max_tokens + 16,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    out: dict = {
        "model": args.model,
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "config": {
            f: getattr(llm.config, f)
            for f in ("kernel_backend", "cuda_graphs", "async_scheduling", "max_num_batched_tokens", "batch_invariant")
        },
        "build_s": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(out), file=sys.stderr, flush=True)

    def params(seed: int, forced: tuple[int, ...] | None = None) -> SamplingParams:
        return SamplingParams(
            max_tokens=args.max_tokens,
            temperature=1.0,
            top_p=0.7,
            logprobs=5,
            seed=seed,
            ignore_eos=True,
            forced_token_ids=forced or (),
        )

    t0 = time.perf_counter()
    batch = llm.generate(prompts, [params(1000 + k) for k in range(args.num_prompts)])
    out["batch_s"] = round(time.perf_counter() - t0, 1)
    print(f"batch done in {out['batch_s']} s", file=sys.stderr, flush=True)
    runner = llm.engine.worker.runner

    def counters() -> tuple[int, int]:
        return getattr(runner, "num_replays", 0), getattr(runner, "num_eager", 0)

    t0 = time.perf_counter()
    differ = []
    for k, (prompt, together) in enumerate(zip(prompts, batch)):
        t_prompt, (replays, eager) = time.perf_counter(), counters()
        if k < args.profile_alone:
            import cProfile
            import pstats

            with cProfile.Profile() as prof:
                alone = llm.generate(prompt, params(7 + k, tuple(together.token_ids)))[0]
            pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(25)
        else:
            alone = llm.generate(prompt, params(7 + k, tuple(together.token_ids)))[0]
        timing = (
            f"{time.perf_counter() - t_prompt:.2f} s, {counters()[0] - replays} replays, "
            f"{counters()[1] - eager} eager steps"
        )
        fields = {
            "token_ids": (alone.token_ids, together.token_ids),
            "logprobs": (alone.logprobs, together.logprobs),
            "top_logprobs": (alone.top_logprobs, together.top_logprobs),
        }
        bad = {
            name: next(i for i, (a, b) in enumerate(zip(*pair)) if a != b)
            for name, pair in fields.items()
            if pair[0] != pair[1]
        }
        print(
            f"prompt {k} ({len(prompt)} tokens) alone: {'differs ' + str(bad) if bad else 'equal'} ({timing})",
            file=sys.stderr,
            flush=True,
        )
        if bad:
            i = min(bad.values())
            differ.append({"prompt": k, "first_index": bad, "alone": alone.logprobs[i], "batch": together.logprobs[i]})
    out["alone_s"] = round(time.perf_counter() - t0, 1)
    out["equal"] = args.num_prompts - len(differ)
    out["differ"] = differ[:8]
    out["graph_replays"], out["eager_steps"] = counters()
    print(json.dumps(out), flush=True)
    return 0 if not differ else 1


if __name__ == "__main__":
    raise SystemExit(main())
