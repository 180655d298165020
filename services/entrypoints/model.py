"""``shinkai model``: model utilities.
``shinkai model init --preset {tiny,v41-s1} --out DIR [--seed N] [--num-layers N] [--device DEV]``."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="model checkpoints")
    commands = parser.add_subparsers(dest="model_command", required=True)
    init = commands.add_parser("init", help="write a random checkpoint in the released formats")
    init.add_argument(
        "--preset",
        required=True,
        help="tiny (CPU default; one model.safetensors) or v41-s1 (sharded; ~84 GB at full depth)",
    )
    init.add_argument("--out", required=True, help="output directory")
    init.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    init.add_argument(
        "--num-layers",
        type=int,
        default=None,
        help="write only the first N layers (sharded, one layer per shard); v41-s1 with 14: ~37 GB",
    )
    init.add_argument(
        "--device",
        default=None,
        help="where sharded weights are drawn: cpu, cuda, cuda:N (default: cuda when available)",
    )
    init.set_defaults(func=_init)


def _init(args: argparse.Namespace) -> int:
    from model.deepseek_v41.init import init_preset
    from model.deepseek_v41.presets import PRESETS
    from services.entrypoints.cli import UsageError

    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}; choose one of {', '.join(PRESETS)}")
    try:
        out = init_preset(args.preset, args.out, args.seed, args.num_layers, args.device, log=print)
    except ValueError as err:
        raise UsageError(str(err)) from None
    print(f"wrote {args.preset} checkpoint (seed {args.seed}) to {out}")
    return 0
