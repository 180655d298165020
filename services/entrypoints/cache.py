"""`shinkai cache`: the compile caches (services/cache_dirs.py), their directories, sizes and entries; `shinkai cache
clear` empties them."""

from __future__ import annotations

import argparse
import sys

from services.cache_dirs import CACHES


def register(subparsers: argparse._SubParsersAction) -> None:
    cache = subparsers.add_parser("cache", help="the compile caches: directory, size, entries; `cache clear` empties")
    cache.set_defaults(func=_show)
    commands = cache.add_subparsers(dest="cache_command")
    show = commands.add_parser("show", help="each cache's directory, size and entry count (the default)")
    show.set_defaults(func=_show)
    clear = commands.add_parser("clear", help="empty the caches (all, or those named); the next start compiles again")
    for c in CACHES:
        clear.add_argument(f"--{c.name}", action="store_true", help=f"the {c.name} cache")
    clear.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
    clear.set_defaults(func=_clear)


def _size(num_bytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if num_bytes < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024  # type: ignore[assignment]
    raise AssertionError


def _show(_args: argparse.Namespace) -> int:
    from services.cache_dirs import usage

    print(f"{'cache':<10} {'entries':>8} {'size':>10}  directory")
    for c in CACHES:
        u = usage(c)
        print(f"{u.name:<10} {u.num_entries:>8} {_size(u.num_bytes):>10}  {u.path}")
    return 0


def _clear(args: argparse.Namespace) -> int:
    from services.cache_dirs import clear, usage
    from services.entrypoints.cli import UsageError

    chosen = [c for c in CACHES if getattr(args, c.name)] or list(CACHES)
    for c in chosen:
        u = usage(c)
        print(f"{u.name:<10} {u.num_entries:>8} entries {_size(u.num_bytes):>10}  {u.path}")
    if not args.yes:
        if not sys.stdin.isatty():
            raise UsageError("clearing needs confirmation: pass --yes")
        answer = input(f"empty {len(chosen)} cache(s)? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing cleared")
            return 1
    for c in chosen:
        try:
            cleared = clear(c)
        except ValueError as err:
            raise UsageError(str(err)) from err
        print(f"cleared {cleared.name}: {cleared.num_entries} entries, {_size(cleared.num_bytes)}")
    return 0
