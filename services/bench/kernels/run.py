"""Kernel microbenchmarks (`shinkai bench kernels`): each kernel against its roofline and the torch op.

The two ceilings are re-measured in the same run: HBM bandwidth by a large device-to-device copy
(bytes read + written) and the FP8 matrix peak by a large ``torch._scaled_mm``. A kernel's roofline
time is max(bytes / bandwidth, FLOPs / peak), with bytes the fewest it must move (each input read
once, each output written once; for the MoE GEMMs only the weights of experts that have tokens).
Times are medians of ``triton.testing.do_bench``, which flushes the L2 cache before every call.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from services.bench import harness as timing

if TYPE_CHECKING:  # torch loads only when a benchmark runs, so `--help` stays fast
    import torch

# v41-s1 (Flash per-layer shapes): hidden 5120, expert intermediate 2304, 48 experts, top-6.
HIDDEN, INTER, EXPERTS, TOP_K, SWIGLU_LIMIT = 5120, 2304, 48, 6, 10.0
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
QUICK_DECODE_TOKENS = (1, 64, 256)
NORM_TOKENS = (256, 4096, 16384)
SWEEP = [  # (block_m, block_n, num_warps, num_stages, programs_per_sm); None = the launcher's default
    (None, 128, 8, 3, 2),
    (32, 128, None, 3, 2),
    (None, 128, None, 4, 1),
    (None, 64, None, 3, 4),
]
SWEEP_TOKENS = (128, 256)  # where the default launch configs fell short in the kernel bench
# Kernels benchmarked in their own modules, ``services/bench/kernels_<name>.py``, each exposing
# ``bench(ceil, quick, gen) -> list[row]`` built with ``kernel_timing._row`` (one file per kernel, like kernels/).
EXTRA = (
    "indexer",
    "compressor",
    "mhc",
    "prefill_attention",
    "sampler",
    "decode_gemms",
    "prefill_gemms",
    "prefill_moe",
    "deepgemm_moe",
    "moe_splitk",
    "moe_configs",
)


def bench_rmsnorm(num_tokens: int, ceil: dict[str, float]) -> dict[str, object]:
    import torch
    import torch.nn.functional as F

    from kernels.rmsnorm import rmsnorm

    x = torch.randn(num_tokens, HIDDEN, device=timing.DEVICE, dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, device=timing.DEVICE)
    w_bf16 = w.to(x.dtype)
    ours = timing._bench_replay(lambda: rmsnorm(x, w, 1e-20))
    theirs = timing._bench_replay(lambda: F.rms_norm(x, (HIDDEN,), w_bf16, 1e-20))
    nbytes = 2 * x.numel() * x.element_size() + w.numel() * 4
    return timing._row(
        "rmsnorm", f"T={num_tokens} C={HIDDEN} bf16", ours, nbytes, 0.0, ceil, theirs, "torch: F.rms_norm"
    )


def bench_router(num_tokens: int, ceil: dict[str, float]) -> dict[str, object]:
    import torch

    from kernels import reference
    from kernels.moe_router import moe_router

    x = torch.randn(num_tokens, HIDDEN, device=timing.DEVICE, dtype=torch.bfloat16)
    gate = (torch.randn(EXPERTS, HIDDEN, device=timing.DEVICE) * 0.02).to(torch.bfloat16)
    bias = torch.randn(EXPERTS, device=timing.DEVICE) * 0.1
    ours = timing._bench_replay(lambda: moe_router(x, gate, bias, TOP_K, 1.5))
    theirs = timing._bench_replay(lambda: reference.moe_router(x, gate, bias, TOP_K, 1.5))
    nbytes = x.numel() * 2 + gate.numel() * 2 + bias.numel() * 4 + num_tokens * TOP_K * 8
    # fp32 IEEE logits run on the CUDA cores, not the FP8 units: the roofline here is bytes only.
    return timing._row(
        "moe router",
        f"T={num_tokens} E={EXPERTS} k={TOP_K} D={HIDDEN}",
        ours,
        nbytes,
        0.0,
        ceil,
        theirs,
        "torch: the reference's ops (linear, softplus, sort)",
    )


def _moe_problem(num_tokens: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    import torch

    from kernels.reference import route_metadata

    experts = torch.rand(num_tokens, EXPERTS, device=timing.DEVICE, generator=gen).argsort(-1)[:, :TOP_K]
    weights = torch.rand(num_tokens, TOP_K, device=timing.DEVICE, generator=gen)
    return route_metadata(experts, weights, EXPERTS)


def _random_weights(
    n: int, k: int, gen: torch.Generator, num_experts: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 weights [E, n, k] (E = ``EXPERTS`` unless given) and power-of-two block scales."""
    import torch

    num_experts = EXPERTS if num_experts is None else num_experts
    w = (torch.randn(num_experts, n, k, device=timing.DEVICE, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.exp2(
        torch.randint(-9, -5, (num_experts, n // 128, k // 128), device=timing.DEVICE, generator=gen).float()
    )
    return w, scale


def _torch_grouped(a_fp8: torch.Tensor, w: torch.Tensor, meta: dict[str, torch.Tensor]) -> Callable[[], object]:
    """``torch._scaled_grouped_mm`` on the same grouping: 2-D tokens sorted by expert × 3-D weights."""
    import torch

    offs = torch.cumsum(meta["counts"], 0).to(torch.int32)
    scale_a = torch.ones(a_fp8.shape[0], device=timing.DEVICE)
    scale_b = torch.ones(w.shape[0], w.shape[1], device=timing.DEVICE)
    w_t = w.transpose(1, 2)  # [E, K, N], column-major per expert
    return lambda: torch._scaled_grouped_mm(a_fp8, w_t, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


def bench_moe(num_tokens: int, ceil: dict[str, float], sweep: bool, gen: torch.Generator) -> list[dict[str, object]]:
    """Both MoE GEMMs at one decode batch: bf16 input quantised in the GEMM's loop, and the
    pre-quantised path (x quantised once; h handed from the SwiGLU epilogue as e4m3 + scales)."""
    import torch

    from kernels.moe_grouped_gemm import Activations, moe_grouped_gemm
    from kernels.quant_fp8 import quantize_act

    meta = _moe_problem(num_tokens, gen)
    num_active = int(meta["num_active"])
    picks = num_tokens * TOP_K
    x = torch.randn(num_tokens, HIDDEN, device=timing.DEVICE, dtype=torch.bfloat16, generator=gen)
    w13, s13 = _random_weights(2 * INTER, HIDDEN, gen)
    w2, s2 = _random_weights(HIDDEN, INTER, gen)
    h = moe_grouped_gemm(x, w13, s13, meta, gather=True, swiglu_limit=SWIGLU_LIMIT)
    shape = f"T={num_tokens} E={EXPERTS} k={TOP_K} active={num_active}"
    rows = []
    x_q: Activations | None
    h_q: Activations | None
    try:
        x_q = quantize_act(x)
        h_q = moe_grouped_gemm(
            x_q, w13, s13, meta, gather=True, swiglu_limit=SWIGLU_LIMIT, out_dtype=torch.float8_e4m3fn
        )
        rows.append(
            timing._row(
                "act quant (x → e4m3 1×128)",
                f"T={num_tokens} C={HIDDEN}",
                timing._bench_replay(lambda: quantize_act(x)),
                num_tokens * HIDDEN * 3 + num_tokens * HIDDEN // 32,
                0.0,
                ceil,
                None,
            )
        )
    except Exception as err:  # noqa: BLE001 - keep the bf16 rows when the FP8-input path breaks
        print(f"pre-quantised path failed: {type(err).__name__}: {str(err)[:200]}", file=sys.stderr)
        x_q = h_q = None
    fp8_h_bytes = picks * INTER * (1 + 4 / 128)
    cases: tuple[tuple[str, dict[str, Any], int, int, float], ...] = (  # name, kwargs, N_w, K, activation bytes
        (
            "moe gate/up+swiglu bf16→bf16",
            dict(a=x, w=w13, w_scale=s13, gather=True, swiglu_limit=SWIGLU_LIMIT),
            2 * INTER,
            HIDDEN,
            num_tokens * HIDDEN * 2 + picks * INTER * 2,
        ),
        (
            "moe gate/up+swiglu fp8→fp8",
            dict(a=x_q, w=w13, w_scale=s13, gather=True, swiglu_limit=SWIGLU_LIMIT, out_dtype=torch.float8_e4m3fn),
            2 * INTER,
            HIDDEN,
            num_tokens * HIDDEN * (1 + 4 / 128) + fp8_h_bytes,
        ),
        (
            "moe down bf16→bf16",
            dict(a=h, w=w2, w_scale=s2, gather=False),
            HIDDEN,
            INTER,
            picks * INTER * 2 + picks * HIDDEN * 2,
        ),
        (
            "moe down fp8→bf16",
            dict(a=h_q, w=w2, w_scale=s2, gather=False),
            HIDDEN,
            INTER,
            fp8_h_bytes + picks * HIDDEN * 2,
        ),
    )
    torch_times: dict[int, tuple[float | None, str]] = {}  # N_w → the stock op on the same GEMM
    for name, kwargs, n_w, k, act_bytes in cases:
        if kwargs["a"] is None:
            continue
        nbytes = num_active * (n_w * k + (n_w // 128) * (k // 128) * 4) + act_bytes
        flops = 2.0 * picks * n_w * k
        if n_w not in torch_times:
            a_sorted = torch.randn(picks, k, device=timing.DEVICE, generator=gen).to(torch.float8_e4m3fn)
            try:
                torch_times[n_w] = (
                    timing._bench_replay(_torch_grouped(a_sorted, kwargs["w"], meta)),
                    "torch: _scaled_grouped_mm rowwise (no SwiGLU, no quant), graph replay",
                )
            except Exception as err:  # noqa: BLE001 - report, don't die, when the stock op refuses a shape
                torch_times[n_w] = (None, f"torch op failed: {type(err).__name__}: {str(err)[:80]}")
        theirs, torch_note = torch_times[n_w]

        def call(kw: dict[str, Any] = kwargs) -> object:
            return moe_grouped_gemm(**kw, meta=meta)

        row = timing._row(
            name, f"{shape} N={n_w} K={k}", timing._bench_replay(call), nbytes, flops, ceil, theirs, torch_note
        )
        eager, graph = timing._bench(call), timing._bench_graph(call)
        row.update(eager_us=eager * 1e6, graph_us=graph * 1e6, graph_tb_s=nbytes / graph / 1e12)
        rows.append(row)
        if sweep and num_tokens in SWEEP_TOKENS and "fp8" in name:
            configs = [
                dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
                for block_m, block_n, warps, stages, per_sm in SWEEP
                if block_n == 128 or "fp8→fp8" not in name
            ]  # the FP8 epilogue needs whole 128-channel groups
            tried, best = timing.sweep_configs("", configs, lambda c, kw=kwargs: moe_grouped_gemm(**kw, meta=meta, **c))
            row["sweep"] = tried
            if best is not None:
                rows.append(
                    timing._row(
                        name + " [best of sweep]",
                        f"{shape} N={n_w} K={k}",
                        best[0],
                        nbytes,
                        flops,
                        ceil,
                        theirs,
                        str(best[1]),
                    )
                )
    return rows


def _bench_module(name: str, ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, object]]:
    import importlib
    import importlib.util

    module_name = f"services.bench.kernels_{name}"
    if importlib.util.find_spec(module_name) is None:
        print(f"{name}: no benchmark module {module_name} yet; nothing measured")
        return []
    try:
        return importlib.import_module(module_name).bench(ceil, quick, gen)
    except Exception as exc:  # one kernel's failure is reported; the other kernels are still measured
        import traceback

        traceback.print_exc()
        print(f"{name}: FAILED ({type(exc).__name__}: {exc}); its rows are missing")
        return [
            timing._row(f"{name} FAILED", f"{type(exc).__name__}", float("nan"), 0.0, 0.0, ceil, None, str(exc)[:200])
        ]


def _fmt(v: object, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict[str, object]]) -> None:
    head = (
        f"{'kernel':44} {'shape':48} {'us':>7} {'TB/s':>5} {'TFLOP/s':>7} {'%roof':>5} {'torch us':>8} "
        f"{'x torch':>7} {'eager us':>8} {'b2b us':>7} {'TB/s':>5}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['kernel']:44} {r['shape']:48} {_fmt(r['us'], '7.1f')} {_fmt(r['tb_s'], '5.2f')} "
            f"{_fmt(r['tflop_s'], '7.1f')} {_fmt(r['pct_roofline'], '5.1f')} {_fmt(r['torch_us'], '8.1f')} "
            f"{_fmt(r['speedup_vs_torch'], '7.2f')} {_fmt(r.get('eager_us'), '8.1f')} "
            f"{_fmt(r.get('graph_us'), '7.1f')} {_fmt(r.get('graph_tb_s'), '5.2f')}"
        )
    print(
        "us: one graph replay, L2 flushed before each (the headline); eager us: plain launches, L2 flushed;"
        " b2b us: back-to-back replays, no flush"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a few minutes)")
    parser.add_argument(
        "--sweep", action="store_true", help="also time small sweeps of MoE GEMM and decode attention configs"
    )
    parser.add_argument("--json", dest="json_path", help="write the figures as JSON here")
    parser.add_argument(
        "--only",
        choices=("all", "moe", "attention", *EXTRA),
        default="all",
        help="attention: the sparse decode attention rows alone; moe: norm, router and MoE GEMMs; "
        "any other name: that kernel's module alone",
    )


NOTHING_MEASURED = 3  # exit code of a run that measured nothing (no GPU, or no benchmark selected)


def main(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():  # a run that measured nothing must not read as a success
        print(
            "shinkai bench kernels: no CUDA device here; the kernel benchmarks need a GPU. Nothing was measured.",
            file=sys.stderr,
        )
        return NOTHING_MEASURED
    torch.manual_seed(0)
    gen = torch.Generator(device=timing.DEVICE).manual_seed(0)
    only = getattr(args, "only", "all")
    ceil = {
        "bandwidth": timing.measure_bandwidth(),
        "fp8_peak": timing.measure_fp8_peak(),
        "bf16_peak": timing.measure_bf16_peak(),
    }
    print(
        f"device: {torch.cuda.get_device_name()}  HBM copy: {ceil['bandwidth'] / 1e12:.2f} TB/s  "
        f"FP8 _scaled_mm 8192³: {ceil['fp8_peak'] / 1e12:.0f} TFLOP/s  bf16 mm 8192³: "
        f"{ceil['bf16_peak'] / 1e12:.0f} TFLOP/s"
    )
    rows: list[dict[str, object]] = []
    if only in ("all", "moe"):  # "moe" keeps its first meaning: the norm, router and grouped GEMM rows
        rows += [bench_rmsnorm(t, ceil) for t in ((16384,) if args.quick else NORM_TOKENS)]
        rows += [bench_router(t, ceil) for t in (1, 256)]
        for t in QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS:
            rows += bench_moe(t, ceil, args.sweep, gen)
    if only in ("all", "attention"):
        from services.bench.kernels.decode_attention import ATTN_CONTEXTS, bench_decode_attention

        for context in ATTN_CONTEXTS:
            for t in QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS:
                rows += bench_decode_attention(t, context, ceil, args.sweep, gen)
    for name in EXTRA:
        if only in ("all", name):
            rows += _bench_module(name, ceil, args.quick, gen)
    if not rows:
        print(f"shinkai bench kernels: --only {only} selected no benchmark. Nothing was measured.", file=sys.stderr)
        return NOTHING_MEASURED
    print_table(rows)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "bandwidth_tb_s": ceil["bandwidth"] / 1e12,
        "fp8_peak_tflop_s": ceil["fp8_peak"] / 1e12,
        "bf16_peak_tflop_s": ceil["bf16_peak"] / 1e12,
        "command": "shinkai bench kernels"
        + (" --quick" if args.quick else "")
        + (" --sweep" if args.sweep else "")
        + (f" --only {only}" if only != "all" else ""),
        "rows": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows],
    }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # `python -m services.bench.kernels.run`: the same command without the rest of the CLI
    _parser = argparse.ArgumentParser(prog="shinkai bench kernels")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
