"""`shinkai bench step`: whole engine steps against the hardware floor, and the same step three ways.

Sections (each measured in this run, with the ceilings re-measured first on a GPU):

- host: the host's share of a decode step at each batch, device work stubbed (``host_step``), with async
  scheduling's split by phase (``step_phases``);
- decode: step time at each batch × context (``step_timing.time_decode``: real plans, prefill
  skipped, pools filled), its floor (``floors.step_cost``), efficiency = floor / time, and a fitted
  cost curve a + b·rows per context;
- prefill: one chunk of N prompt tokens through the engine;
- offline throughput with async scheduling off and on (unprofiled, with its host ms per decode step by
  phase), and the GPU-busy fraction (kernel time over wall time of a second, profiled run of the same work)
  at the largest batch; alone: ``python -m services.bench.step.offline``;
- three ways: the model's eager PyTorch path (the torch backend), the same with each layer
  ``torch.compile``d, and the engine's backend, on the same model and steps; ratios printed.

Results go to JSON (``--json``) and a Markdown table (``--markdown``); ``--baseline`` is an earlier
JSON whose decode times give the ratio to the previous version.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
from pathlib import Path
from typing import Any

from services.bench.step.report import markdown

QUICK = {"batches": (1, 64, 256), "contexts": (4096,), "prefill": (1024, 4096), "steps": 5}
FULL = {"batches": (1, 16, 64, 128, 256), "contexts": (4096, 32768), "prefill": (1024, 4096, 16384, 32768), "steps": 10}
CPU = {"batches": (1, 4), "contexts": (64,), "prefill": (32,), "steps": 3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="preset: v41-s1 on a GPU (default there), tiny on CPU")
    parser.add_argument(
        "--layers",
        type=int,
        default=None,
        help="keep the first N layers (times are also reported scaled to the full depth)",
    )
    parser.add_argument(
        "--backend",
        choices=("torch", "kernels"),
        default=None,
        help="the engine's runner backend (default: kernels on a GPU, torch on CPU)",
    )
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a few minutes)")
    parser.add_argument(
        "--no-graphs",
        action="store_true",
        help="decode eagerly (default on a GPU with the kernel backend: CUDA graphs, as cuda_graphs=True)",
    )
    parser.add_argument("--no-compare", action="store_true", help="skip the eager/compiled comparison")
    parser.add_argument("--no-async", action="store_true", help="skip the async on/off throughput run")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also profile decode steps at the smallest and largest batch: time per kernel",
    )
    parser.add_argument("--batches", help="decode batch sizes, comma-separated (replaces the mode's)")
    parser.add_argument("--contexts", help="decode context lengths, comma-separated (replaces the mode's)")
    parser.add_argument("--prefill-tokens", help="prefill chunk sizes, comma-separated (replaces the mode's)")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="also time decode and a prefill step with the batch-invariant mode on, beside it off",
    )
    parser.add_argument(
        "--penalties",
        action="store_true",
        help="also time decode with presence, frequency and repetition penalties, min_p and min_tokens on every "
        "request (the sampler kernel's pass 0 and the token counts) against off, alternated on one build",
    )
    parser.add_argument(
        "--expert-format",
        default="fp4",
        help="routed experts on the kernel backend: fp4 (MXFP4 as released), fp8, or fp8,fp4 to time decode "
        "with each (one model at a time; the other sections run on the last)",
    )
    parser.add_argument("--json", dest="json_path", help="write the figures as JSON here")
    parser.add_argument("--markdown", help="write the tables as Markdown here")
    parser.add_argument("--baseline", help="JSON of an earlier run: report the ratio of decode times against it")
    parser.add_argument(
        "--ep-path",
        action="store_true",
        help="with --dp 1 on a GPU: decode with the expert-parallel kernel layer at world size 1 (NCCL to itself, "
        "fixed-capacity buffers, the exchange in the graphs) against the engine without it, alternated "
        "(services/bench/step/ep_path.py)",
    )
    parser.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel ranks: time their lockstep decode steps and the expert exchange's "
        "share instead (CPU, services/bench/step/parallel.py)",
    )


def _override(sizes: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """The mode's sizes with those given on the command line."""
    out = dict(sizes, penalties=bool(getattr(args, "penalties", False)))
    for key, value in (("batches", args.batches), ("contexts", args.contexts), ("prefill", args.prefill_tokens)):
        if value:
            try:
                out[key] = tuple(int(v) for v in value.split(","))
            except ValueError:
                raise SystemExit(
                    f"--{key.replace('prefill', 'prefill-tokens')}: expected comma-separated integers, got {value!r}"
                ) from None
            if any(v <= 0 for v in out[key]):
                raise SystemExit(f"--{key}: sizes must be positive, got {value!r}")
    return out


def _ceilings(device) -> dict[str, float]:
    if device.type != "cuda":
        return {}
    from services.bench.harness import measure_bandwidth, measure_bf16_peak, measure_fp8_peak

    return {"bandwidth": measure_bandwidth(), "fp8_peak": measure_fp8_peak(), "bf16_peak": measure_bf16_peak()}


def _decode_section(build, cfg, sizes, ceil, full_layers: int, expert_format: str | None) -> list[dict[str, Any]]:
    """Decode rows at each batch and context; ``expert_format`` (None: the torch backend's fp32 experts) tags
    them and picks the floor's expert bytes."""
    from services.bench.step.build import runner_cache
    from services.bench.step.floors import step_cost
    from services.bench.step.timing import StepTimes, decode_model_len, fit_line, time_decode

    rows = []
    for context in sizes["contexts"]:
        measured = []
        for batch in sizes["batches"]:
            try:  # one size failing (e.g. memory at 256 × 32K) keeps the others' rows
                llm = build(max_num_seqs=batch, max_model_len=decode_model_len(batch, context, sizes["steps"]))

                def timed(penalties: bool, llm=llm) -> StepTimes:
                    return time_decode(
                        llm.engine,
                        runner_cache(llm),
                        batch=batch,
                        context=context,
                        steps=sizes["steps"],
                        vocab_size=cfg.vocab_size,
                        penalties=penalties,
                    )

                t = timed(False)
                if sizes.get("penalties"):  # on one build, alternated: off, on, off, on
                    on = timed(True)
                    off, on2 = timed(False), timed(True)
                    rows.append(_penalties_row(batch, context, [t, off], [on, on2]))
            except Exception as exc:
                print(f"decode  ctx {context:>6} batch {batch:>4}: FAILED: {type(exc).__name__}: {exc}")
                rows.append(
                    {
                        "section": "decode failed",
                        "batch": batch,
                        "context": context,
                        "error": f"{type(exc).__name__}: {exc}",
                    }
                )
                llm = None
                continue
            floor = (
                step_cost(cfg, batch, context, prefill=False, expert_format=expert_format).floor(ceil) if ceil else None
            )
            row = {
                "section": "decode",
                "expert_format": expert_format,
                "batch": batch,
                "context": context,
                "ms": t.median * 1e3,
                "ms_full_depth": t.median * 1e3 * full_layers / cfg.num_hidden_layers,
                "floor_ms": None if floor is None else floor * 1e3,
                "efficiency": None if floor is None else floor / t.median,
                "tokens_per_s": batch / t.median,
            }
            rows.append(row)
            measured.append((batch, t.median))
            print(
                f"decode  ctx {context:>6} batch {batch:>4}: {row['ms']:9.2f} ms"
                + (f"  floor {row['floor_ms']:.2f} ms  ({100 * row['efficiency']:.1f}%)" if floor else "")
            )
            del llm
        if len({m[0] for m in measured}) < 2:  # a line needs two batch sizes
            continue
        a, b = fit_line([m[0] for m in measured], [m[1] for m in measured])
        rows.append({"section": "decode fit", "context": context, "a_ms": a * 1e3, "b_us_per_row": b * 1e6})
        print(f"decode  ctx {context:>6}: step ≈ {a * 1e3:.2f} ms + {b * 1e6:.1f} µs · rows")
    return rows


def _penalties_row(batch: int, context: int, off: list, on: list) -> dict[str, Any]:
    """Decode with every sampling parameter on against off, from alternated runs on one build (their steps pooled)."""
    import statistics

    ms_off = statistics.median([x for t in off for x in t.seconds]) * 1e3
    ms_on = statistics.median([x for t in on for x in t.seconds]) * 1e3
    print(
        f"decode  ctx {context:>6} batch {batch:>4}: penalties off {ms_off:.3f} ms, "
        f"on {ms_on:.3f} ms ({ms_on / ms_off:.3f}×)"
    )
    return {
        "section": "decode penalties",
        "batch": batch,
        "context": context,
        "ms_off": ms_off,
        "ms_on": ms_on,
        "ratio": ms_on / ms_off,
        "steps_per_side": sum(len(t.seconds) for t in on),
    }


def _prefill_section(build, cfg, sizes, ceil) -> list[dict[str, Any]]:
    from services.bench.step.build import runner_cache
    from services.bench.step.floors import step_cost
    from services.bench.step.timing import time_prompt_step

    rows = []
    for tokens in sizes["prefill"]:
        seconds = []
        try:  # one size failing (e.g. memory at 32K) keeps the others' rows
            llm = build(max_num_seqs=1, max_model_len=tokens + 8, max_num_batched_tokens=tokens)
            seconds.append(time_prompt_step(llm.engine, runner_cache(llm).blocks.device, tokens, cfg.vocab_size))
        except Exception as exc:
            print(f"prefill {tokens:>6} tokens: FAILED: {type(exc).__name__}: {exc}")
            rows.append({"section": "prefill failed", "tokens": tokens, "error": f"{type(exc).__name__}: {exc}"})
            llm = None
            continue
        floor = step_cost(cfg, tokens, tokens, prefill=True).floor(ceil) if ceil else None
        rows.append(
            {
                "section": "prefill",
                "tokens": tokens,
                "ms": seconds[-1] * 1e3,
                "floor_ms": None if floor is None else floor * 1e3,
                "efficiency": None if floor is None else floor / seconds[-1],
            }
        )
        print(
            f"prefill {tokens:>6} tokens: {seconds[-1] * 1e3:9.2f} ms"
            + (f"  floor {floor * 1e3:.2f} ms" if floor else "")
        )
        del llm
    return rows


def _host_section(sizes) -> list[dict[str, Any]]:
    from services.bench.step.host_step import host_section

    return host_section(sizes["batches"], sizes["contexts"][0])


def _profile_section(build, cfg, sizes) -> list[dict[str, Any]]:
    from services.bench.step.build import runner_cache
    from services.bench.step.profile import launches_line, print_kernels, profile_decode, profile_prefill
    from services.bench.step.timing import decode_model_len

    rows = []
    context = sizes["contexts"][0]
    for batch in sorted({min(sizes["batches"]), max(sizes["batches"])}):
        llm = build(max_num_seqs=batch, max_model_len=decode_model_len(batch, context, sizes["steps"]))
        p = profile_decode(
            llm.engine, runner_cache(llm), batch=batch, context=context, steps=sizes["steps"], vocab_size=cfg.vocab_size
        )
        rows.append({"section": "profile", **p})
        print(
            f"profile ctx {context} batch {batch}: {p['wall_ms']:.2f} ms per step (profiled), device busy "
            f"{p['busy_ms']:.2f} ms; {launches_line(p)}"
        )
        print_kernels(p["kernels"])
        del llm
    tokens = max(sizes["prefill"])
    llm = build(max_num_seqs=1, max_model_len=tokens + 8, max_num_batched_tokens=tokens)
    p = profile_prefill(llm.engine, runner_cache(llm).blocks.device, tokens=tokens, vocab_size=cfg.vocab_size)
    rows.append({"section": "profile", "batch": 1, "context": tokens, "prefill_tokens": tokens, **p})
    print(
        f"profile prefill {tokens} tokens: {p['wall_ms']:.2f} ms (profiled), device busy {p['busy_ms']:.2f} ms; "
        f"{launches_line(p)}"
    )
    print_kernels(p["kernels"])
    return rows


def _result(args, device, model, cfg, backend, ceil, rows) -> dict[str, Any]:
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "command": _command(args),
        "model": model,
        "layers": cfg.num_hidden_layers,
        "backend": backend,
        "torch": torch.__version__,
        "ceilings": dict(ceil),
        "rows": rows,
    }


def _write(args: argparse.Namespace, result: dict[str, Any]) -> None:
    """After every section, so a run cut short still leaves what it measured."""
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(markdown(result))


def _command(args: argparse.Namespace) -> str:
    flags = [
        f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
        for k, v in vars(args).items()
        if k
        in (
            "model",
            "layers",
            "backend",
            "quick",
            "no_graphs",
            "no_compare",
            "no_async",
            "profile",
            "batches",
            "contexts",
            "prefill_tokens",
            "batch_invariant",
            "penalties",
        )
        and v not in (None, False)
    ]
    return " ".join(["shinkai bench step", *flags])


def main(args: argparse.Namespace) -> int:
    if args.dp > 1:
        from services.bench.step.parallel import main as parallel_main

        return parallel_main(args)
    if args.ep_path:
        from services.bench.step.ep_path import main as ep_path_main

        return ep_path_main(args)
    import torch

    from services.bench.step.build import builder

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = args.model or ("v41-s1" if device.type == "cuda" else "tiny")
    backend = args.backend or ("kernels" if device.type == "cuda" else "torch")
    sizes = QUICK if args.quick else FULL
    if device.type == "cpu":
        torch.set_num_threads(1)
        sizes = CPU
    sizes = _override(sizes, args)
    ceil = _ceilings(device)
    graphs = device.type == "cuda" and backend == "kernels" and not args.no_graphs
    formats = args.expert_format.split(",")
    if any(f not in ("fp4", "fp8") for f in formats):
        raise SystemExit(f"--expert-format: fp4, fp8 or both comma-separated, got {args.expert_format!r}")
    kernel = backend == "kernels"
    if not kernel:  # the torch backend keeps the model's fp32 experts: one build, no format
        formats = formats[-1:]
    rows: list[dict[str, Any]] = []
    for earlier in formats[:-1]:  # decode only; the model is dropped before the next format's is built
        build, cfg, full_layers = builder(model, device, backend, args.layers, graphs, earlier)
        print(f"experts {earlier}: GPU memory after the build {_allocated_gib(device):.1f} GiB")
        rows += _decode_section(build, cfg, sizes, ceil, full_layers, earlier)
        del build
        import gc

        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    build, cfg, full_layers = builder(model, device, backend, args.layers, graphs, formats[-1])
    print(
        f"model {model} ({cfg.num_hidden_layers} of {full_layers} layers), backend {backend}, "
        f"CUDA graphs {graphs}, experts {formats[-1]}, device "
        f"{torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor() or 'cpu'}"
    )
    if device.type == "cuda":
        print(
            f"GPU memory after the build: {torch.cuda.memory_allocated() / 2**30:.1f} GiB allocated, peak "
            f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB"
        )
    if ceil:
        print(
            f"HBM {ceil['bandwidth'] / 1e12:.2f} TB/s, FP8 {ceil['fp8_peak'] / 1e12:.0f} TFLOP/s, "
            f"bf16 {ceil['bf16_peak'] / 1e12:.0f} TFLOP/s (measured now)"
        )
    sections = [
        ("host", lambda: _host_section(sizes)),
        ("decode", lambda: _decode_section(build, cfg, sizes, ceil, full_layers, formats[-1] if kernel else None)),
        ("prefill", lambda: _prefill_section(build, cfg, sizes, ceil)),
    ]
    if args.batch_invariant:
        from services.bench.step.invariant import batch_invariant_section

        sections.append(("batch-invariant", lambda: batch_invariant_section(build, cfg, sizes)))
    if args.profile:
        sections.append(("profile", lambda: _profile_section(build, cfg, sizes)))
    if not args.no_async:
        from services.bench.step.offline import offline_section

        sections.append(("offline", lambda: offline_section(build, cfg, max(sizes["batches"]), sizes["steps"] * 4)))
    if not args.no_compare:
        from services.bench.step.compare import compare

        def _compare() -> list[dict[str, Any]]:
            nonlocal build  # the engine's model is dropped first: the comparison builds its own
            build = None
            import gc

            gc.collect()
            torch.cuda.empty_cache() if device.type == "cuda" else None
            return compare(model, device, args.layers, sizes)

        sections.append(("three ways", _compare))
    for name, run in sections:
        try:
            rows += run()
        except Exception as exc:  # a section that fails is reported, and the others still run
            print(f"{name}: FAILED: {type(exc).__name__}: {exc}")
            rows.append({"section": f"{name} failed", "error": f"{type(exc).__name__}: {exc}"})
        _write(args, _result(args, device, model, cfg, backend, ceil, rows))
    _versus_fp8(rows)
    result = _result(args, device, model, cfg, backend, ceil, rows)
    if args.baseline:
        base = {
            (r["batch"], r["context"]): r["ms"]
            for r in json.loads(Path(args.baseline).read_text())["rows"]
            if r["section"] == "decode"
        }
        for r in rows:
            if r["section"] == "decode" and (r["batch"], r["context"]) in base:
                r["vs_baseline"] = base[(r["batch"], r["context"])] / r["ms"]
    print(markdown(result))
    _write(args, result)
    return 1 if any(r["section"].endswith("failed") for r in rows) else 0


def _allocated_gib(device) -> float:
    import torch

    return torch.cuda.memory_allocated() / 2**30 if device.type == "cuda" else 0.0


def _versus_fp8(rows: list[dict[str, Any]]) -> None:
    """Each FP4 decode row gains ``vs_fp8``: the FP8 row's time at its batch and context over its own."""
    fp8 = {
        (r["batch"], r["context"]): r["ms"]
        for r in rows
        if r["section"] == "decode" and r.get("expert_format") == "fp8"
    }
    for r in rows:
        if r["section"] == "decode" and r.get("expert_format") == "fp4" and (r["batch"], r["context"]) in fp8:
            r["vs_fp8"] = fp8[(r["batch"], r["context"])] / r["ms"]
            print(f"decode batch {r['batch']:>4} ctx {r['context']}: FP4 experts {r['vs_fp8']:.2f}× FP8's speed")


if __name__ == "__main__":
    from services import cache_dirs

    cache_dirs.setup()  # as under `shinkai bench step` (services/cache_dirs.py)
    _parser = argparse.ArgumentParser(prog="shinkai bench step")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
