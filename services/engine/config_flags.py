"""The engine's command-line flags, the same on ``generate``, ``serve``, ``up`` and the engine process: each
``add_*_arguments`` adds a group to a parser, and its ``*_args`` gives the ``EngineConfig`` fields the parsed flags
set (docs/serving.md names the defaults)."""

from __future__ import annotations

import argparse

from services.engine.config import EngineConfig


def add_speculative_arguments(parser) -> None:
    """``--num-speculative-tokens``, ``--spec-sampling`` and ``--spec-varlen``, the same on generate, serve, up
    and the engine."""
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="DSpark drafts verified per request and step (0: off; docs/speculative.md)",
    )
    parser.add_argument(
        "--spec-sampling",
        choices=("rejection", "deterministic"),
        default="rejection",
        help="how drafts are accepted: rejection sampling, or position-keyed coupling whose "
        "seeded tokens do not depend on the drafts (default: rejection)",
    )
    parser.add_argument(
        "--spec-varlen",
        action="store_true",
        help="variable-length verification: per request, verify the drafts worth their rows, "
        "ranked by the draft's confidence against the measured step-cost curve",
    )


def speculative_args(args) -> dict[str, object]:
    """The engine arguments the flags of ``add_speculative_arguments`` set (none when speculation is off)."""
    if not args.num_speculative_tokens:
        return {"spec_varlen": True} if args.spec_varlen else {}  # EngineConfig refuses it, naming the flag's field
    return {
        "num_speculative_tokens": args.num_speculative_tokens,
        "spec_sampling": args.spec_sampling,
        "spec_varlen": args.spec_varlen,
    }


def add_step_arguments(parser) -> None:
    """``--max-num-batched-tokens``, ``--scheduling`` and prefix caching's flags, the same on generate, serve, up
    and the engine."""
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="rows per step, the token budget: decode rows first, then prompt chunks cut to the rest "
        f"(default {EngineConfig.max_num_batched_tokens})",
    )
    parser.add_argument(
        "--scheduling",
        choices=("mixed", "separate"),
        default=None,
        help="mixed: decode rows and prompt chunks in one step, so a new prompt never stalls the running "
        "streams; separate: prompt-or-decode steps, as DeepInfer (default: mixed)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="keep full blocks cached by content hash and state snapshots, so a request resumes after a cached "
        "prefix with the same tokens as without (default: on)",
    )
    parser.add_argument(
        "--num-state-snapshots",
        type=int,
        default=None,
        help="state snapshots prefix caching keeps, each a state slot's bytes (default 4 × --max-num-seqs)",
    )


def step_args(args) -> dict[str, object]:
    """The engine arguments the flags of ``add_step_arguments`` set (those given)."""
    given = (
        ("max_num_batched_tokens", args.max_num_batched_tokens),
        ("scheduling", args.scheduling),
        ("enable_prefix_caching", args.enable_prefix_caching),
        ("num_state_snapshots", args.num_state_snapshots),
    )
    return {k: v for k, v in given if v is not None}


def step_argv(args: dict[str, object]) -> list[str]:
    """The command-line flags of ``step_args``' result, for a child process (``shinkai up``'s engines)."""
    flags = []
    for k, v in args.items():
        name = k.replace("_", "-")
        flags.append((f"--{name}" if v else f"--no-{name}") if isinstance(v, bool) else f"--{name}={v}")
    return flags


def add_parallel_arguments(parser) -> None:
    """``--data-parallel-size`` (alias ``--dp``) and ``--num-redundant-experts`` (docs/parallelism.md)."""
    parser.add_argument(
        "--data-parallel-size",
        "--dp",
        dest="data_parallel_size",
        type=int,
        default=1,
        help="rank processes in lockstep, each with its own scheduler and caches, the routed "
        "experts spread over them (default 1: one process)",
    )
    parser.add_argument(
        "--num-redundant-experts",
        type=int,
        default=0,
        help="at least this many extra expert copies over the ranks, rounded up so every rank "
        "holds the same number of slots (default 0)",
    )


def parallel_args(args) -> dict[str, object]:
    """The engine arguments the flags of ``add_parallel_arguments`` set (none for one process)."""
    if args.data_parallel_size == 1:
        return {}
    return {"data_parallel_size": args.data_parallel_size, "num_redundant_experts": args.num_redundant_experts}
