"""The `shinkai` command line. Each command group lives in its own module and registers itself here.

A command module exposes ``register(subparsers)``; it adds its parser and sets ``func`` to a callable
taking the parsed arguments and returning an exit code. Heavy imports stay inside those callables so
``shinkai --help`` is fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# command group -> module that registers it
COMMAND_MODULES = {
    "generate": "services.entrypoints.generate",
    "bench": "services.entrypoints.bench",
    "model": "services.entrypoints.model",
    "eplb": "services.entrypoints.eplb_cli",
    "serve": "services.entrypoints.serve",
    "up": "services.entrypoints.up",  # registers `up`, `down` and `status`
    "cache": "services.entrypoints.cache",
}


class UsageError(Exception):
    """A bad argument or input file: reported as one line on stderr with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="shinkai", description="Shinkai inference engine")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command, module_name in COMMAND_MODULES.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as err:
            if err.name is not None and module_name.startswith(err.name):
                continue  # that command group is not built yet
            # A dependency is missing (the Rust extension before it is built): the other groups still work.
            _register_unavailable(subparsers, command, err)
            continue
        module.register(subparsers)
    return parser


def _register_unavailable(subparsers: argparse._SubParsersAction, command: str, err: ModuleNotFoundError) -> None:
    def unavailable(_args: argparse.Namespace) -> int:
        raise UsageError(f"needs {err.name}, which is not importable ({err}); build it with `. scripts/dev/dev-env.sh`")

    # No option prefix: every argument lands in "rest", so the missing dependency is the error reported.
    parser = subparsers.add_parser(command, help=f"unavailable: needs {err.name}", add_help=False, prefix_chars="\x00")
    parser.add_argument("rest", nargs="*")
    parser.set_defaults(func=unavailable)


def main(argv: list[str] | None = None) -> int:
    from services import cache_dirs

    cache_dirs.setup()  # before any command compiles; `up`'s services inherit the variables
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as err:
        print(f"shinkai {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:  # a parser that registered, then a command needing what is not built
        if err.name is None or not err.name.startswith("scheduler_rs"):
            raise
        print(
            f"shinkai {args.command}: error: needs {err.name}, which is not importable ({err}); build it with "
            "`. scripts/dev/dev-env.sh`",
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    # Under `python -m services.entrypoints.cli` this file is `__main__`; run the importable module instead, so the
    # UsageError that command modules raise is the class `main` catches.
    from services.entrypoints.cli import main as _main

    sys.exit(_main())
