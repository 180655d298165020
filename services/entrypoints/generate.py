"""`shinkai generate`: offline generation from the command line."""

from __future__ import annotations

import argparse
import json
import sys


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("generate", help="generate text offline with the engine")
    p.add_argument("--model", default="tiny", help="checkpoint directory or preset name (default: tiny)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for several")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per prompt (default 16)")
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
    p.add_argument(
        "--eplb-layout",
        default=None,
        help="with --dp N: a layout JSON (or a plan from `shinkai eplb plan --output`) that every MoE layer moves to "
        "during the run; the experts move beside the steps and the new slot map takes effect at one step "
        "boundary on every rank (docs/parallelism.md, 'Applying an EPLB layout'); the step it took effect at "
        "is printed on stderr",
    )
    p.add_argument(
        "--eplb-layout-at-step",
        type=int,
        default=0,
        help="the step before which the ranks receive --eplb-layout (default 0: before the first)",
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
            **{
                k: v
                for k, v in (("max_model_len", args.max_model_len), ("max_num_seqs", args.max_num_seqs))
                if v is not None
            },
            **device_args(args),
            **speculative_args(args),
            **step_args(args),
            **parallel_args(args),
            "batch_invariant": args.batch_invariant,
            "engram_on_host": args.engram_on_host,
        }
        layout = None if args.eplb_layout is None else _read_layout(args)  # before any rank starts
        llm = LLM(model=args.model, **{**engine_args, **kernel_args(args.kernels, engine_args)})
        try:
            moved = None if layout is None else _submit_layout(llm, layout, args.eplb_layout_at_step)
            outputs = llm.generate(args.prompt, params, use_tqdm=len(args.prompt) > 1)
            if moved is not None:
                _report_switch(llm, *moved)
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


def _read_layout(args: argparse.Namespace):
    """``--eplb-layout``, checked against the group the other flags make (its ranks, experts and slots)."""
    import pathlib

    from services.engine.model_source import load_model
    from services.eplb.layout import Layout, LayoutError, startup_layout

    path, dp = pathlib.Path(args.eplb_layout), args.data_parallel_size
    if dp < 2:
        raise ValueError("--eplb-layout moves experts between ranks: it needs --dp 2 or more")
    if args.eplb_layout_at_step < 0:
        raise ValueError(f"--eplb-layout-at-step must be ≥ 0, got {args.eplb_layout_at_step}")
    num_experts = load_model(args.model, weights=False).config.n_routed_experts
    try:
        layout = Layout.from_dict(json.loads(path.read_text()), num_experts)
    except (OSError, json.JSONDecodeError, LayoutError) as err:
        raise ValueError(f"--eplb-layout {path}: {err}") from None
    group = startup_layout(num_experts, dp, args.num_redundant_experts)
    if (layout.num_gpus, layout.num_logical, layout.num_slots) != (dp, num_experts, group.num_slots):
        raise ValueError(
            f"--eplb-layout {path}: a layout of {layout.num_logical} experts in {layout.num_slots} slots over "
            f"{layout.num_gpus} ranks; this group has {num_experts} experts in {group.num_slots} slots over {dp} ranks"
        )
    return layout


def _submit_layout(llm, layout, at_step: int) -> tuple[int, int]:
    """``layout`` submitted for every MoE layer, received before step ``at_step``; (its version, the boundaries
    the ranks had seen before this run)."""
    from services.engine.parallel.rank import eplb_switches

    (_, first), *_ = llm.ranks.call(eplb_switches)
    return llm.ranks.submit_layouts(dict.fromkeys(range(llm.source.config.num_hidden_layers), layout), at_step), first


def _report_switch(llm, version: int, first: int) -> None:
    """On stderr: the step of this run from which ``version`` was in force, or that it took effect after it."""
    from services.engine.parallel.rank import eplb_switches

    (switches, seen), *_ = llm.ranks.call(eplb_switches)  # agreed: every rank's are the same
    num_steps = seen - first - 1  # a boundary before each step, and the last, which found no work
    at = [boundary - first for v, boundary in switches if v == version]
    if at and at[0] < num_steps:
        print(f"EPLB layout version {version} in force from step {at[0]} of {num_steps}", file=sys.stderr)
        return
    llm.ranks.settle_layouts()
    print(f"EPLB layout version {version} in force after the run's {num_steps} steps", file=sys.stderr)
