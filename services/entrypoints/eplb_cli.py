"""`shinkai eplb`: plan a layout from recorded loads, replay a trace under each mode, make a test trace.

shinkai eplb plan --load FILE --num-gpus G --num-redundant R [--current LAYOUT.json]
                  [--policy deepinfer|deepseek|guarded] [--output PLAN.json]
shinkai eplb simulate --trace FILE --interval K --window W [--plot PNG] [--output RESULT.json]
shinkai eplb compare [--per-shape 40] [--window]   (guarded against DeepSeek's reference)
shinkai eplb trace --num-experts E --steps T --output FILE   (drifting Zipf, for simulate)
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import time

from services.entrypoints.cli import UsageError

# Largest count (GPUs, experts, copies, steps, groups, nodes) the CLI accepts: far beyond any real layer,
# small enough that no derived array overflows memory.
MAX_COUNT = 1 << 20


def _integer(text: str, minimum: int, maximum: int = MAX_COUNT) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not minimum <= value <= maximum:
        raise argparse.ArgumentTypeError(f"must be ≥ {minimum} and ≤ {maximum}, got {value}")
    return value


def _positive(text: str) -> int:
    return _integer(text, 1)


def _non_negative(text: str) -> int:
    return _integer(text, 0)


def _byte_count(text: str) -> int:
    return _integer(text, 0, 1 << 50)


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not (math.isfinite(value) and value >= 0):
        raise argparse.ArgumentTypeError(f"must be a finite number ≥ 0, got {text}")
    return value


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("eplb", help="expert-parallel load balancing: plan and simulate")
    commands = parser.add_subparsers(dest="eplb_command", required=True)

    p = commands.add_parser("plan", help="plan one layer's layout from recorded loads")
    p.add_argument("--load", required=True, help="steps × experts token counts (.json, .npy or .csv)")
    p.add_argument("--num-gpus", type=_positive, required=True, help="expert-parallel size")
    p.add_argument(
        "--num-redundant",
        type=_non_negative,
        required=True,
        help="at least this many extra copies (rounded up so slots divide by GPUs)",
    )
    p.add_argument(
        "--current", help="layout now in use (JSON with phy2log and num_gpus, or a plan); default: the start-up layout"
    )
    p.add_argument(
        "--policy",
        choices=("deepinfer", "deepseek", "guarded"),
        default="guarded",
        help="deepinfer / deepseek: apply that policy unchecked; guarded (default): fewest moves "
        "within --tolerance of the best layout found, applied only if it gains --threshold",
    )
    p.add_argument(
        "--threshold",
        type=_non_negative_float,
        default=0.01,
        help="least drop in moe_lb for a guarded plan to apply (default 0.01)",
    )
    p.add_argument(
        "--tolerance",
        type=_non_negative_float,
        default=0.002,
        help="guarded: moe_lb above the best found worth accepting to move fewer experts (default 0.002)",
    )
    p.add_argument(
        "--num-groups",
        type=_positive,
        default=1,
        help="deepseek: expert groups; hierarchical when --num-nodes divides it (default 1)",
    )
    p.add_argument("--num-nodes", type=_positive, default=1, help="deepseek: server nodes (default 1)")
    p.add_argument("--holdout", help="a later load window (same format) the guarded plan must also improve")
    p.add_argument("--no-local-search", action="store_true", help="skip the guarded local-search pass")
    p.add_argument(
        "--expert-bytes",
        type=_byte_count,
        default=None,
        help="weight bytes per expert copy (default: DeepSeek-V4.1 MXFP4, 18,800,640)",
    )
    p.add_argument("--output", help="write the plan as JSON here")
    p.set_defaults(func=_plan)

    s = commands.add_parser("simulate", help="re-plan along a recorded trace under each mode")
    s.add_argument("--trace", required=True, help="steps × experts token counts (.json, .npy or .csv)")
    s.add_argument("--interval", type=_positive, required=True, help="re-plan every K steps (first at K/4)")
    s.add_argument("--window", type=_positive, required=True, help="plan from the last W steps")
    s.add_argument("--num-gpus", type=_positive, default=8)
    s.add_argument("--num-redundant", type=_non_negative, default=8)
    s.add_argument(
        "--modes",
        default="static,deepinfer,deepseek,guarded",
        help="comma-separated among static, deepinfer, deepseek, guarded",
    )
    s.add_argument("--threshold", type=_non_negative_float, default=0.01)
    s.add_argument("--tolerance", type=_non_negative_float, default=0.002)
    s.add_argument(
        "--holdout",
        type=_non_negative,
        default=None,
        help="keep the window's last N steps out of planning; guarded must improve them too "
        "(default: window // 4; 0 turns it off)",
    )
    s.add_argument("--no-local-search", action="store_true")
    s.add_argument("--plot", help="save moe_lb over time and moves per re-plan as a PNG")
    s.add_argument("--output", help="write the per-mode results as JSON")
    s.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    s.set_defaults(func=_simulate)

    c = commands.add_parser("compare", help="guarded against DeepSeek's reference policy on seeded loads")
    c.add_argument("--per-shape", type=_positive, default=40, help="seeded loads per shape (default 40)")
    c.add_argument(
        "--window",
        action="store_true",
        help="score on the 8-step windows (default: on their sum, the reference's own input)",
    )
    c.add_argument("--threshold", type=_non_negative_float, default=0.01)
    c.add_argument("--tolerance", type=_non_negative_float, default=0.002)
    c.set_defaults(func=_compare)

    t = commands.add_parser("trace", help="write a drifting-Zipf load trace for simulate")
    t.add_argument("--num-experts", type=_positive, required=True)
    t.add_argument("--steps", type=_positive, required=True)
    t.add_argument("--tokens-per-step", type=lambda text: _integer(text, 0, 1 << 40), default=4096)
    t.add_argument("--exponent", type=_non_negative_float, default=1.0, help="Zipf exponent")
    t.add_argument(
        "--drift",
        type=_non_negative_float,
        default=0.03,
        help="random-walk step of each expert's log-popularity per step",
    )
    t.add_argument("--seed", type=_non_negative, default=0)
    t.add_argument("--output", required=True, help=".npy, .csv or .json")
    t.set_defaults(func=_trace)


def _read_load(path: str):
    from services.eplb.loads import LoadFileError, read_load

    try:
        return read_load(path)
    except LoadFileError as err:
        raise UsageError(str(err)) from None


def _write_json(path: str, data: object) -> None:
    try:
        pathlib.Path(path).write_text(json.dumps(data, indent=1) + "\n")
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None


def _plan(args: argparse.Namespace) -> int:
    from services.eplb.deepseek import DeepSeekShapeError, check_shape
    from services.eplb.guarded import PlanConfig, plan
    from services.eplb.layout import V41_EXPERT_BYTES, LayoutError, startup_layout
    from services.eplb.loads import LoadFileError, read_layout

    load = _read_load(args.load)
    num_logical = load.shape[1]
    try:
        startup = startup_layout(num_logical, args.num_gpus, args.num_redundant)
        current = startup if args.current is None else read_layout(args.current, num_logical, args.num_gpus)
        check_shape(num_logical, startup.num_slots, args.num_gpus, args.num_groups, args.num_nodes)
    except DeepSeekShapeError as err:
        raise UsageError(f"--num-groups {args.num_groups} / --num-nodes {args.num_nodes}: {err}") from None
    except (LayoutError, LoadFileError) as err:
        raise UsageError(str(err)) from None
    if current.num_slots != startup.num_slots:
        raise UsageError(
            f"{args.current}: layout has {current.num_slots} slots, but {num_logical} experts + "
            f"--num-redundant {args.num_redundant} on {args.num_gpus} GPUs gives {startup.num_slots}"
        )
    holdout = None if args.holdout is None else _read_load(args.holdout)
    if holdout is not None and holdout.shape[1] != num_logical:
        raise UsageError(f"{args.holdout}: {holdout.shape[1]} experts, but --load has {num_logical}")
    config = PlanConfig(
        policy=args.policy,
        threshold=args.threshold,
        tolerance=args.tolerance,
        num_groups=args.num_groups,
        num_nodes=args.num_nodes,
        local_search=not args.no_local_search,
        expert_bytes=V41_EXPERT_BYTES if args.expert_bytes is None else args.expert_bytes,
    )
    began_wall, began_cpu = time.perf_counter(), time.process_time()
    result = plan(load, current, config, holdout=holdout)
    wall, cpu = time.perf_counter() - began_wall, time.process_time() - began_cpu
    verdict = "applied" if result.applied else "rejected"
    print(
        f"policy {result.policy}: {load.shape[0]} steps, {num_logical} experts, {current.num_gpus} GPUs × "
        f"{current.slots_per_gpu} slots ({current.num_slots - num_logical} redundant)"
    )
    print(
        f"moe_lb current {result.moe_lb_before:.4f}, candidate {result.moe_lb_candidate:.4f}: {verdict} "
        f"({result.reason})"
    )
    if result.holdout_before is not None:
        print(f"held-out window: current {result.holdout_before:.4f}, candidate {result.holdout_candidate:.4f}")
    print(
        f"moe_lb after {result.moe_lb_after:.4f}; moves {result.moves} "
        f"({result.bytes_moved / 1e6:.1f} MB); the candidate alone would move {result.candidate_moves}"
    )
    if result.tradeoff:
        print(
            f"trade-off seen (fewest moves at each moe_lb; the pick is the fewest moves within "
            f"{args.tolerance} of the best, from {result.source}):"
        )
        for point in result.tradeoff:
            print(f"  moe_lb {point.moe_lb:.4f}  moves {point.moves:>5}  {point.source}")
    print(f"planned in {wall:.2f} s ({cpu:.2f} s CPU)")
    if current.num_slots <= 64:
        for g, experts in enumerate(result.layout.gpu_experts()):
            print(f"  GPU{g}: {experts}")
    if args.output:
        _write_json(args.output, result.to_dict())
        print(f"wrote {args.output}")
    return 0


def _simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from services.eplb.guarded import PlanConfig
    from services.eplb.simulate import MODES, plot_runs, replan_steps, run_mode

    trace = _read_load(args.trace)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown or not modes:
        raise UsageError(f"--modes takes a comma-separated list of {', '.join(MODES)}; got {args.modes!r}")
    if args.holdout is None:
        args.holdout = args.window // 4
    if args.holdout >= args.window:
        raise UsageError(f"--holdout {args.holdout} must be smaller than --window {args.window}")
    if args.interval >= trace.shape[0]:
        raise UsageError(f"--interval {args.interval} must be shorter than the trace ({trace.shape[0]} steps)")
    config = PlanConfig(threshold=args.threshold, tolerance=args.tolerance, local_search=not args.no_local_search)
    points = replan_steps(trace.shape[0], args.interval)
    total = len(points) * sum(m != "static" for m in modes)
    runs = []
    with tqdm(total=total, desc="re-plans", unit="plan", disable=args.no_progress) as bar:
        for mode in modes:
            bar.set_postfix_str(mode)
            runs.append(
                run_mode(
                    trace,
                    mode,
                    num_gpus=args.num_gpus,
                    num_redundant=args.num_redundant,
                    interval=args.interval,
                    window=args.window,
                    config=config,
                    holdout=args.holdout,
                    on_replan=lambda: bar.update(1),
                )
            )
    print(
        f"{trace.shape[0]} steps × {trace.shape[1]} experts, {args.num_gpus} GPUs, re-plan every "
        f"{args.interval} (first at {points[0] if points else '-'}), window {args.window}"
    )
    print(f"{'mode':<10} {'moe_lb':>7} {'re-plans':>8} {'applied':>7} {'moves':>6} {'moves/re-plan':>13}")
    for run in runs:
        s = run.summary()
        print(
            f"{s['mode']:<10} {s['moe_lb']:>7.4f} {s['replans']:>8} {s['applied']:>7} {s['total_moves']:>6} "
            f"{s['moves_per_replan']:>13.1f}"
        )
    bounds = [0] + points + [trace.shape[0]]
    print("moe_lb over time (each span runs one layout; moves = experts moved at its start):")
    print("  steps        " + " ".join(f"{m:>16}" for m in modes))
    for k, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        cells = []
        for run in runs:
            moves = run.replans[k - 1].moves if k > 0 and run.replans else 0
            cells.append(f"{run.moe_lb(lo, hi):>8.4f} ({moves:>3} mv)")
        print(f"  {lo:>5}-{hi:<6} " + " ".join(f"{c:>16}" for c in cells))
    if args.plot:
        try:
            plot_runs(runs, max(1, args.interval // 4), args.plot)
        except OSError as err:
            raise UsageError(f"cannot write {args.plot}: {err.strerror}") from None
        print(f"wrote {args.plot}")
    if args.output:
        _write_json(
            args.output,
            {
                "trace": str(args.trace),
                "interval": args.interval,
                "window": args.window,
                "num_gpus": args.num_gpus,
                "num_redundant": args.num_redundant,
                "holdout": args.holdout,
                "threshold": args.threshold,
                "modes": [
                    dict(
                        run.summary(),
                        replans=[r.__dict__ for r in run.replans],
                        series=run.series(max(1, args.interval // 4)),
                    )
                    for run in runs
                ],
            },
        )
        print(f"wrote {args.output}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    from services.eplb.compare import NUM_STEPS, SHAPES, compare_shape
    from services.eplb.guarded import PlanConfig

    config = PlanConfig(threshold=args.threshold, tolerance=args.tolerance)
    scored = f"{NUM_STEPS}-step windows" if args.window else "the summed load"
    print(
        f"{args.per_shape} seeded loads per shape (uniform, Zipf, one-hot), from the start-up layout, "
        f"scored on {scored}"
    )
    print(
        f"{'shape':<12} {'reference':>9} {'guarded':>8} {'≤1.01×':>7} {'worse':>5} {'better':>6} "
        f"{'worst':>6} {'ref moves':>9} {'moves':>6} {'cpu/plan':>8}"
    )
    for shape in SHAPES:
        s = compare_shape(shape, args.per_shape, summed=not args.window, config=config)
        e, g, r = s.shape
        print(
            f"{f'{e}/{g}/{r}':<12} {s.reference_mean:>9.4f} {s.guarded_mean:>8.4f} {s.within_1pct:>7.0%} "
            f"{s.num_worse:>5} {s.num_better:>6} {s.worst_ratio:>6.4f} {s.reference_moves:>9.1f} "
            f"{s.guarded_moves:>6.1f} {s.guarded_cpu_s:>7.3f}s"
        )
    return 0


def _trace(args: argparse.Namespace) -> int:
    import numpy as np

    from services.eplb.simulate import zipf_drift_trace

    path = pathlib.Path(args.output)
    if path.suffix not in (".npy", ".csv", ".json"):
        raise UsageError(f"{path}: --output must end in .npy, .csv or .json")
    trace = zipf_drift_trace(
        num_experts=args.num_experts,
        num_steps=args.steps,
        tokens_per_step=args.tokens_per_step,
        exponent=args.exponent,
        drift=args.drift,
        seed=args.seed,
    )
    try:
        if path.suffix == ".npy":
            np.save(path, trace)
        elif path.suffix == ".csv":
            np.savetxt(path, trace, fmt="%d", delimiter=",")
        else:
            path.write_text(json.dumps({"load": trace.tolist()}) + "\n")
    except OSError as err:
        raise UsageError(f"cannot write {path}: {err.strerror}") from None
    print(f"wrote {path}: {trace.shape[0]} steps × {trace.shape[1]} experts, {args.tokens_per_step} tokens/step")
    return 0
