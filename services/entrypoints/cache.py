"""`shinkai cache`: the compile caches (services/cache_dirs.py), their directories, sizes and entries; `shinkai cache
clear` empties them; `shinkai cache prune` removes the compile manifests no start can load any more, and optionally
those unused for some days (services/worker/manifest_prune.py); `shinkai cache compile` compiles the manifests'
variants into Triton's cache without a GPU (services/worker/manifest_compile.py)."""

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
    prune = commands.add_parser(
        "prune",
        help="remove the compile manifests (variants) of other Triton or torch versions, their entries whose kernel "
        "is gone or changed, writers' leftovers, and with --older-than those unused for that many days",
    )
    prune.add_argument("--older-than", type=float, default=None, metavar="DAYS", help="also manifests unused this long")
    prune.add_argument("--dry-run", action="store_true", help="list what would go; remove nothing")
    prune.set_defaults(func=_prune)
    compile_ = commands.add_parser(
        "compile",
        help="compile every compile manifest's variants into Triton's cache for the GPU its key names, on this "
        "machine's CPUs (no GPU needed): a node or an image given the manifests then starts warm",
    )
    compile_.add_argument("--processes", type=int, default=None, help="compiling processes (default: the CPUs but one)")
    compile_.set_defaults(func=_compile)


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


def _prune(args: argparse.Namespace) -> int:
    import os

    from services.cache_dirs import directory
    from services.entrypoints.cli import UsageError
    from services.worker.compile_manifest import VARIANTS
    from services.worker.manifest_prune import prune

    if args.older_than is not None and args.older_than < 0:
        raise UsageError(f"--older-than is a number of days, at least 0; got {args.older_than}")
    older_than_s = None if args.older_than is None else args.older_than * 86400
    root = directory(VARIANTS)
    removed = prune(root, older_than_s=older_than_s, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for r in removed:
        print(f"{verb} {os.path.relpath(r.path, root)}  {_size(r.num_bytes)}  ({r.why})")
    print(f"{verb} {len(removed)} item(s), {_size(sum(r.num_bytes for r in removed))} from {root}")
    return 0


def _compile(args: argparse.Namespace) -> int:
    import os

    from services import cache_dirs
    from services.entrypoints.cli import UsageError
    from services.worker.compile_manifest import VARIANTS
    from services.worker.manifest_compile import compile_manifests

    if args.processes is not None and args.processes < 1:
        raise UsageError(f"--processes is at least 1; got {args.processes}")
    cache_dirs.setup()  # Triton's cache directory under the root, as an engine sets it
    root = cache_dirs.directory(VARIANTS)
    results = compile_manifests(root, args.processes)
    for r in results:
        name = os.path.relpath(r.path, root)
        if r.skipped is not None:
            print(f"skipped {name}: {r.skipped}")
        else:
            print(
                f"compiled {name} for {r.target[0]} sm_{r.target[1]}: {r.num_entries - r.num_failed} of "  # type: ignore[index]
                f"{r.num_entries} variants ({r.num_failed} failed), {r.seconds:.1f} s of compiles"
            )
    print(f"{len(results)} manifest(s) under {root}; Triton's cache: {os.environ['TRITON_CACHE_DIR']}")
    return 1 if any(r.num_failed for r in results) else 0
