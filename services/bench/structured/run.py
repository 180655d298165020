"""`shinkai bench structured`: what structured output costs a decode step, a grammar compile and a mask fill.

1. Decode steps (decode_steps.py): step time at each batch with every request constrained by a typical JSON schema
   (and, at the ``--worst-batches``, by the worst case for the mask fill: a tool call whose raw string parameter is
   bounded by ``maxLength``), against the same rounds unconstrained, with async scheduling off and on, all on one
   engine, kinds and modes alternated. The target: constrained ≤ 5% slower than unconstrained at batch 64 with
   async scheduling (the mask fill overlapped with the step in flight).
2. Grammar compiles (grammar_costs.py) over the repository's constraint set: the first compile (the vocabulary's
   tables), then median, p99 and max per constraint.
3. Mask fills (grammar_costs.py): one row's fill along random walks of the typical schema and of the worst case.

The model: ``tiny`` on the CPU (the torch runner); on a GPU v41-s1 by default, cut to ``--layers`` (bench step's
subsets), on the kernel backend with CUDA graphs. Stdlib-only at import (the CLI registers it); torch loads when it
runs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
from pathlib import Path

TARGET_RATIO = 1.05  # constrained / unconstrained step time at the target batch, async scheduling on
TARGET_BATCH = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="preset: v41-s1 on a GPU (default there), tiny on the CPU")
    p.add_argument("--layers", "--num-layers", type=int, default=None, help="keep this many layers (bench step's)")
    p.add_argument("--batches", default="1,16,64", help="decode batch sizes, comma-separated (default 1,16,64)")
    p.add_argument("--worst-batches", default="1,16", help="batches also run with the worst case ('' for none)")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per round at most (default 32)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of every kind and mode (default 2)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens per request (default 32)")
    p.add_argument("--modes", default="sync,async", help="async scheduling off (sync) and/or on (async)")
    p.add_argument("--no-graphs", action="store_true", help="decode eagerly on a GPU")
    p.add_argument("--no-compiles", action="store_true", help="skip the compile section")
    p.add_argument("--constraint-dir", help="schemas.json and patterns.json to compile (default: the repository's set)")
    p.add_argument("--walks", type=int, default=8, help="random walks per grammar for the mask fills (default 8)")
    p.add_argument("--walk-tokens", type=int, default=256, help="tokens per walk at most (default 256)")
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    p.add_argument("--json", dest="json_path", help="write the figures as JSON here")


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True)
        return out.stdout.strip() or None
    except (OSError, subprocess.CalledProcessError):
        return None


def targets(rows: list[dict], batch: int = TARGET_BATCH) -> list:
    """The ≤ 5% target at ``batch`` with async scheduling, for the typical schema (targets.py's form)."""
    from services.bench.targets import Target

    return [
        Target(f"batch {batch} async constrained/unconstrained step time", r["vs_unconstrained"], TARGET_RATIO)
        for r in rows
        if r["async"] and r["batch"] == batch and r["kind"] == "typical" and r["vs_unconstrained"] is not None
    ]


def main(args: argparse.Namespace) -> int:
    import torch

    from services.bench.step.build import builder
    from services.bench.structured import decode_steps, grammar_costs, workload
    from services.bench.targets import verdict_lines

    cuda = torch.cuda.is_available()
    model = args.model or ("v41-s1" if cuda else "tiny")
    backend = "kernels" if cuda else "torch"
    if not cuda:
        torch.set_num_threads(args.threads)
    graphs = cuda and not args.no_graphs
    batches, worst_batches = _ints(args.batches), _ints(args.worst_batches)
    modes = [{"sync": False, "async": True}[m.strip()] for m in args.modes.split(",") if m.strip()]
    build, cfg, _ = builder(model, torch.device("cuda" if cuda else "cpu"), backend, args.layers, graphs)
    max_tokens = args.steps + decode_steps.SKIP + 4
    llm = build(max_num_seqs=max(batches), max_model_len=args.prompt_len + max_tokens + 16)
    machine = {
        "device": torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine()),
        "model": model,
        "layers": cfg.num_hidden_layers,
        "backend": backend,
        "cuda_graphs": graphs,
        "torch_threads": torch.get_num_threads(),
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }
    print(f"model {model} ({cfg.num_hidden_layers} layers), backend {backend}, CUDA graphs {graphs}")
    kinds = {"unconstrained": None, "typical": workload.typical()}
    if worst_batches:
        kinds["worst"] = workload.worst()
    only = {"worst": worst_batches}
    # Warm-up: every kind at every batch (grammars compiled, graph sizes captured, shapes seen) before any timing.
    decode_steps.set_async(llm.engine, modes[0])
    for batch in batches:
        for name, constraint in kinds.items():
            if name in only and batch not in only[name]:
                continue
            decode_steps.decode_round(llm, batch, constraint, args.prompt_len, 1, seed=0)
    run = {"date": machine["date"], "commit": machine["commit"], "device": machine["device"]}
    given = {k: v for k, v in vars(args).items() if k != "func"}
    result: dict = {"run": run, "machine": machine, "args": given, "decode": []}

    def save(rows: list[dict]) -> None:
        result["decode"] = rows
        if args.json_path:
            Path(args.json_path).write_text(json.dumps(result, indent=2))

    rows = decode_steps.compare(
        llm, batches, kinds, modes, args.rounds, args.prompt_len, args.steps, only, on_round=save
    )
    save(rows)
    for r in rows:
        print(
            f"decode {'async' if r['async'] else 'sync '} batch {r['batch']:>3} {r['kind']:>13}: "
            f"{r['step_ms_median']} ms/step median ({r['steps']} steps; mean {r['step_ms_mean']}), "
            f"{r['vs_unconstrained']}× unconstrained ({r['extra_ms']} ms more); "
            f"mask fill {r['fill_ms_median']} ms/step; {r['errors']} error finishes"
        )
    grammars = llm.engine.structured.grammars
    result["mask_fill"] = {
        name: grammar_costs.fill_times(grammars, kinds[name], args.walks, args.walk_tokens, seed=7)
        for name in ("typical", "worst")
        if name in kinds
    }
    for name, f in result["mask_fill"].items():
        print(
            f"mask fill {name}: median {f['median_ms']} ms, p99 {f['p99_ms']} ms, max {f['max_ms']} ms "
            f"({f['n']} fills, walks of {f['mean_walk_tokens']} tokens)"
        )
    save(rows)
    if not args.no_compiles:
        c = grammar_costs.compile_times(
            llm.tokenizer,
            cfg.vocab_size,
            cfg.eos_token_id,
            workload.constraint_set(Path(args.constraint_dir) if args.constraint_dir else workload.DATA),
        )
        result["compile"] = c
        print(
            f"compile ({c['n']} constraints): first {c['first_compile_ms']} ms (the vocabulary's tables), then "
            f"median {c['median_ms']} ms, p99 {c['p99_ms']} ms, max {c['max_ms']} ms ({c['slowest']})"
        )
    found = targets(rows)
    result["targets"] = [{"name": t.name, "value": t.value, "limit": t.limit, "met": t.met} for t in found]
    for line in verdict_lines(found) if found else [f"no async batch-{TARGET_BATCH} typical row: no target checked"]:
        print(line)
    print(f"machine: {machine}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # python -m services.bench.structured.run (the same as `shinkai bench structured`)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    add_arguments(parser)
    raise SystemExit(main(parser.parse_args()))
