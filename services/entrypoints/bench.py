"""`shinkai bench ...` command group."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    targets = bench.add_subparsers(dest="target", required=True)
    sched = targets.add_parser(
        "scheduler",
        help="replay the walkthrough's kitchen, then time schedule()+update() at scale",
    )
    sched.add_argument("--num-requests", type=int, default=256, help="running requests (default 256)")
    sched.add_argument("--nextn", type=int, default=5, help="draft tokens per request (default 5)")
    sched.add_argument("--context", type=int, default=4096, help="prompt tokens per request")
    sched.add_argument("--steps", type=int, default=2000, help="timed decode steps")
    sched.add_argument("--json", dest="json_path", help="write the figures as JSON here")
    sched.add_argument("--baseline", help="JSON from an earlier run, to report the ratio against it")
    sched.set_defaults(func=_run_scheduler)
    from services.bench.kernels import run as kernels  # stdlib-only at import; torch loads when it runs

    kern = targets.add_parser("kernels", help="time the Triton kernels against their rooflines and the torch ops")
    kernels.add_arguments(kern)
    kern.set_defaults(func=_run_kernels)
    from services.bench.step import run as step  # stdlib-only at import, like kernels

    step_parser = targets.add_parser(
        "step", help="whole engine steps against the hardware floor; eager vs compiled vs engine"
    )
    step.add_arguments(step_parser)
    step_parser.set_defaults(func=_run_step)
    from services.bench import accuracy  # stdlib-only at import too

    acc = targets.add_parser(
        "accuracy", help="KL and top-1 of the kernel backend (fp8, fp32) against the fp32 torch runner"
    )
    accuracy.add_arguments(acc)
    acc.set_defaults(func=_run_accuracy)
    gen = targets.add_parser("generate", help="tokens/s of LLM(model='tiny').generate at several batch sizes")
    gen.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes (default 1 16)")
    gen.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    gen.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (default 64)")
    gen.add_argument("--block-size", type=int, default=128, help="paged block size (default 128)")
    gen.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    gen.add_argument(
        "--runner",
        choices=("cached", "reference"),
        default="cached",
        help="the cached model runner, or the full-recompute reference runner",
    )
    gen.add_argument("--json", dest="json_path", help="write the figures as JSON here")
    gen.set_defaults(func=_run_generate)
    prefix = targets.add_parser(
        "prefix", help="TTFT, prefill tokens computed and output tok/s of multi-turn and agent loads, cache on vs off"
    )
    from services.bench import prefix as prefix_bench

    prefix_bench.add_arguments(prefix)
    prefix.set_defaults(func=_run_prefix)
    spec = targets.add_parser("speculative", help="tokens/s with DSpark drafts at forced acceptance rates vs off")
    from services.bench.speculative import run as speculative

    speculative.add_arguments(spec)
    spec.set_defaults(func=_run_speculative)
    from services.bench.structured import run as structured  # stdlib-only at import, like kernels

    so = targets.add_parser(
        "structured", help="decode steps constrained by a JSON schema vs unconstrained; grammar compiles, mask fills"
    )
    structured.add_arguments(so)
    so.set_defaults(func=_run_structured)


def _run_scheduler(args: argparse.Namespace) -> int:
    from services.bench import scheduler

    return scheduler.main(args)


def _run_generate(args: argparse.Namespace) -> int:
    from services.bench import generate

    return generate.main(args)


def _run_prefix(args: argparse.Namespace) -> int:
    from services.bench import prefix

    return prefix.main(args)


def _run_speculative(args: argparse.Namespace) -> int:
    from services.bench.speculative import run as speculative

    return speculative.main(args)


def _run_structured(args: argparse.Namespace) -> int:
    from services.bench.structured import run as structured

    return structured.main(args)


def _run_accuracy(args: argparse.Namespace) -> int:
    from services.bench import accuracy

    return accuracy.run(args)


def _run_step(args: argparse.Namespace) -> int:
    from services.bench.step import run as step

    return step.main(args)


def _run_kernels(args: argparse.Namespace) -> int:
    from services.bench.kernels import run as kernels

    return kernels.main(args)
