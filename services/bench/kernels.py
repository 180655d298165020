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

# v41-s1 (Flash per-layer shapes): hidden 5120, expert intermediate 2304, 48 experts, top-6.
HIDDEN, INTER, EXPERTS, TOP_K, SWIGLU_LIMIT = 5120, 2304, 48, 6, 10.0
DECODE_TOKENS = (1, 8, 32, 64, 128, 256)
QUICK_DECODE_TOKENS = (1, 64, 256)
NORM_TOKENS = (256, 4096, 16384)
DEVICE = "cuda"
SWEEP = [  # (block_m, block_n, num_warps, num_stages, programs_per_sm); None = the launcher's default
    (None, 128, None, 4, 1), (None, 128, 8, 3, 2), (None, 64, None, 4, 2), (None, 64, None, 3, 4),
    (None, 128, None, 2, 3), (16, 128, None, 3, 2), (32, 128, None, 3, 2), (64, 64, None, 3, 2),
]


def _bench(fn: Callable[[], object]) -> float:
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e-3  # seconds


def _bench_graph(fn: Callable[[], object]) -> float:
    """Median seconds per call replaying a CUDA graph of the call (no L2 flush; launch gaps removed)."""
    import triton

    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")) * 1e-3


def measure_bandwidth() -> float:
    """Bytes/s of a 2 GiB device copy, counting bytes read plus bytes written."""
    import torch

    src = torch.randn(2**29, device=DEVICE)  # 2 GiB of fp32
    dst = torch.empty_like(src)
    seconds = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds


def measure_fp8_peak(size: int = 8192) -> float:
    """FLOP/s of an e4m3 size³ ``torch._scaled_mm`` (tensor-wise scales, bf16 out) on random data."""
    import torch

    a = torch.randn(size, size, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=DEVICE).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    one = torch.ones((), device=DEVICE)
    seconds = _bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * size**3 / seconds


def _row(name: str, shape: str, seconds: float, nbytes: float, flops: float, ceil: dict[str, float],
         torch_seconds: float | None, note: str = "") -> dict[str, object]:
    roofline = max(nbytes / ceil["bandwidth"], flops / ceil["fp8_peak"])
    return {
        "kernel": name, "shape": shape, "us": seconds * 1e6, "tb_s": nbytes / seconds / 1e12,
        "tflop_s": flops / seconds / 1e12, "roofline_us": roofline * 1e6, "pct_roofline": 100 * roofline / seconds,
        "torch_us": None if torch_seconds is None else torch_seconds * 1e6,
        "torch_tb_s": None if torch_seconds is None else nbytes / torch_seconds / 1e12,
        "speedup_vs_torch": None if torch_seconds is None else torch_seconds / seconds, "note": note,
    }


def bench_rmsnorm(num_tokens: int, ceil: dict[str, float]) -> dict[str, object]:
    import torch
    import torch.nn.functional as F

    from kernels.rmsnorm import rmsnorm

    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, device=DEVICE)
    ours = _bench(lambda: rmsnorm(x, w, 1e-20))
    theirs = _bench(lambda: F.rms_norm(x, (HIDDEN,), w.to(x.dtype), 1e-20))
    nbytes = 2 * x.numel() * x.element_size() + w.numel() * 4
    return _row("rmsnorm", f"T={num_tokens} C={HIDDEN} bf16", ours, nbytes, 0.0, ceil, theirs, "torch: F.rms_norm")


def bench_router(num_tokens: int, ceil: dict[str, float]) -> dict[str, object]:
    import torch

    from kernels import reference
    from kernels.moe_router import moe_router

    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16)
    gate = (torch.randn(EXPERTS, HIDDEN, device=DEVICE) * 0.02).to(torch.bfloat16)
    bias = torch.randn(EXPERTS, device=DEVICE) * 0.1
    ours = _bench(lambda: moe_router(x, gate, bias, TOP_K, 1.5))
    theirs = _bench(lambda: reference.moe_router(x, gate, bias, TOP_K, 1.5))
    nbytes = x.numel() * 2 + gate.numel() * 2 + bias.numel() * 4 + num_tokens * TOP_K * 8
    # fp32 IEEE logits run on the CUDA cores, not the FP8 units: the roofline here is bytes only.
    return _row("moe router", f"T={num_tokens} E={EXPERTS} k={TOP_K} D={HIDDEN}", ours, nbytes, 0.0, ceil, theirs,
                "torch: the reference's ops (linear, softplus, sort)")


def _moe_problem(num_tokens: int, gen: "object") -> dict[str, object]:
    import torch

    from kernels.reference import route_metadata

    experts = torch.rand(num_tokens, EXPERTS, device=DEVICE, generator=gen).argsort(-1)[:, :TOP_K]
    weights = torch.rand(num_tokens, TOP_K, device=DEVICE, generator=gen)
    return route_metadata(experts, weights, EXPERTS)


def _random_weights(n: int, k: int, gen: "object") -> tuple["object", "object"]:
    import torch

    w = (torch.randn(EXPERTS, n, k, device=DEVICE, generator=gen) * 0.5).to(torch.float8_e4m3fn)
    scale = torch.exp2(torch.randint(-9, -5, (EXPERTS, n // 128, k // 128), device=DEVICE, generator=gen).float())
    return w, scale


def _torch_grouped(a_fp8: "object", w: "object", meta: dict[str, "object"]) -> Callable[[], object]:
    """``torch._scaled_grouped_mm`` on the same grouping: 2-D tokens sorted by expert × 3-D weights."""
    import torch

    offs = torch.cumsum(meta["counts"], 0).to(torch.int32)
    scale_a = torch.ones(a_fp8.shape[0], device=DEVICE)
    scale_b = torch.ones(w.shape[0], w.shape[1], device=DEVICE)
    w_t = w.transpose(1, 2)  # [E, K, N], column-major per expert
    return lambda: torch._scaled_grouped_mm(a_fp8, w_t, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16)


def bench_moe(num_tokens: int, ceil: dict[str, float], sweep: bool, gen: "object") -> list[dict[str, object]]:
    import torch

    from kernels.moe_grouped_gemm import moe_grouped_gemm

    meta = _moe_problem(num_tokens, gen)
    num_active = int(meta["num_active"])
    picks = num_tokens * TOP_K
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    w13, s13 = _random_weights(2 * INTER, HIDDEN, gen)
    w2, s2 = _random_weights(HIDDEN, INTER, gen)
    h = moe_grouped_gemm(x, w13, s13, meta, gather=True, swiglu_limit=SWIGLU_LIMIT)
    rows = []
    cases = (
        ("moe gate/up+swiglu", dict(a=x, w=w13, w_scale=s13, gather=True, swiglu_limit=SWIGLU_LIMIT),
         2 * INTER, HIDDEN, num_tokens * HIDDEN * 2 + picks * INTER * 2),
        ("moe down", dict(a=h, w=w2, w_scale=s2, gather=False), HIDDEN, INTER, picks * INTER * 2 + picks * HIDDEN * 2),
    )
    for name, kwargs, n_w, k, act_bytes in cases:
        nbytes = num_active * (n_w * k + (n_w // 128) * (k // 128) * 4) + act_bytes
        flops = 2.0 * picks * n_w * k
        a_sorted = torch.randn(picks, k, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
        try:
            theirs = _bench(_torch_grouped(a_sorted, kwargs["w"], meta))
            torch_note = "torch: _scaled_grouped_mm rowwise, no SwiGLU/quant"
        except Exception as err:  # noqa: BLE001 - report, don't die, when the stock op refuses a shape
            theirs, torch_note = None, f"torch op failed: {type(err).__name__}: {str(err)[:80]}"
        shape = f"T={num_tokens} E={EXPERTS} k={TOP_K} active={num_active} N={n_w} K={k}"
        ours = _bench(lambda: moe_grouped_gemm(**kwargs, meta=meta))
        row = _row(name, shape, ours, nbytes, flops, ceil, theirs, torch_note)
        graph = _bench_graph(lambda: moe_grouped_gemm(**kwargs, meta=meta))
        row.update(graph_us=graph * 1e6, graph_tb_s=nbytes / graph / 1e12)
        rows.append(row)
        if sweep:
            best, tried = None, []
            for block_m, block_n, warps, stages, per_sm in SWEEP:
                cfg = dict(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages, programs_per_sm=per_sm)
                try:
                    t = _bench(lambda: moe_grouped_gemm(**kwargs, meta=meta, **cfg))
                except Exception as err:  # noqa: BLE001 - a config that does not compile is skipped
                    print(f"  config {cfg} failed: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
                    continue
                tried.append({**cfg, "us": t * 1e6})
                if best is None or t < best[0]:
                    best = (t, cfg)
            row["sweep"] = tried
            if best is not None:
                rows.append(_row(name + " [best of sweep]", shape, best[0], nbytes, flops, ceil, theirs, str(best[1])))
    return rows


def _fmt(v: object, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(rows: list[dict[str, object]]) -> None:
    head = (f"{'kernel':36} {'shape':44} {'us':>9} {'TB/s':>6} {'TFLOP/s':>8} {'%roof':>6} {'torch us':>9} "
            f"{'x torch':>7} {'graph us':>9} {'TB/s':>6}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['kernel']:36} {r['shape']:44} {_fmt(r['us'], '9.1f')} {_fmt(r['tb_s'], '6.2f')} "
              f"{_fmt(r['tflop_s'], '8.1f')} {_fmt(r['pct_roofline'], '6.1f')} {_fmt(r['torch_us'], '9.1f')} "
              f"{_fmt(r['speedup_vs_torch'], '7.2f')} {_fmt(r.get('graph_us'), '9.1f')} {_fmt(r.get('graph_tb_s'), '6.2f')}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="fewer sizes (a few minutes)")
    parser.add_argument("--sweep", action="store_true", help="also time a small sweep of MoE GEMM configs")
    parser.add_argument("--json", dest="json_path", help="write the figures as JSON here")


def main(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("shinkai bench kernels: no CUDA device here; the kernel benchmarks need a GPU. Nothing was measured.")
        return 0
    torch.manual_seed(0)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ceil = {"bandwidth": measure_bandwidth(), "fp8_peak": measure_fp8_peak()}
    print(f"device: {torch.cuda.get_device_name()}  HBM copy: {ceil['bandwidth'] / 1e12:.2f} TB/s  "
          f"FP8 _scaled_mm 8192³: {ceil['fp8_peak'] / 1e12:.0f} TFLOP/s")
    rows = [bench_rmsnorm(t, ceil) for t in ((16384,) if args.quick else NORM_TOKENS)]
    rows += [bench_router(t, ceil) for t in (1, 256)]
    for t in QUICK_DECODE_TOKENS if args.quick else DECODE_TOKENS:
        rows += bench_moe(t, ceil, args.sweep, gen)
    print_table(rows)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "python": platform.python_version(),
        "bandwidth_tb_s": ceil["bandwidth"] / 1e12, "fp8_peak_tflop_s": ceil["fp8_peak"] / 1e12,
        "command": "shinkai bench kernels" + (" --quick" if args.quick else "") + (" --sweep" if args.sweep else ""),
        "rows": [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows],
    }
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # `python -m services.bench.kernels`: the same command without the rest of the CLI
    _parser = argparse.ArgumentParser(prog="shinkai bench kernels")
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
