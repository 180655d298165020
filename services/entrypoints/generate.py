"""`shinkai generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text offline with the engine")
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset name (default: tiny)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several")
    p.add_argument("--max-tokens", type=int, default=None, help="output tokens per prompt (default 16)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="same request, same bits alone or in any batch (docs/batch-invariance.md; slower)",
    )
    p.add_argument(
        "--engram-on-host",
        action="store_true",
        help=(
            "Engram tables in host shared memory, one copy per host; each step copies only its rows to the device "
            "(docs/parallelism.md)"
        ),
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per prompt (its logprobs as exact floats: runs compare them with ==)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="prompt plus output tokens")
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=None,
        help="requests a step holds at most; with --dp N it also sizes every rank's expert exchange blocks, so a "
        "small value keeps --kernels interpreted runs quick (default: the engine's)",
    )
    from services.engine.config_flags import add_parallel_arguments, add_speculative_arguments, add_step_arguments
    from services.engine.device import add_device_arguments, add_kernel_arguments

    add_device_arguments(p)
    add_kernel_arguments(p)
    add_speculative_arguments(p)
    add_step_arguments(p)
    add_parallel_arguments(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from services.engine import LLM, SamplingParams
    from services.entrypoints.cli import UsageError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
        )
        from services.engine.config_flags import parallel_args, speculative_args, step_args
        from services.engine.device import device_args, kernel_args

        engine_args = {
            **{k: v for k, v in (("max_model_len", args.max_model_len), ("max_num_seqs", args.max_num_seqs)) if v is not None},
            **device_args(args),
            **speculative_args(args),
            **step_args(args),
            **parallel_args(args),
            "batch_invariant": args.batch_invariant,
            "engram_on_host": args.engram_on_host,
        }
        llm = LLM(model=args.model, **{**engine_args, **kernel_args(args.kernels, engine_args)})
        try:
            outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
        finally:
            llm.close()
    except ValueError as err:
        raise UsageError(str(err)) from err
    for prompt, out in zip(args.prompt, outputs):
        if args.json:
            print(
                json.dumps(
                    {
                        "prompt": prompt,
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "finish_reason": out.finish_reason,
                        "logprobs": out.logprobs,
                    }
                )
            )
        else:
            sys.stdout.write(f"{prompt}{out.text}\n[{out.finish_reason}, {len(out.token_ids)} tokens]\n")
    return 0
