"""The harness of the kernel benchmarks (`shinkai bench kernels`): timers, the two ceilings, config sweeps
and the table row. The driver (services/bench/kernels/run.py) and every per-kernel module
(services/bench/kernels_<name>.py) use it; it imports neither, so the benches form no cycle. Tests replace
the timers and ``DEVICE`` here (module attributes, read at call time).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

DEVICE = "cuda"


def _bench(fn: Callable[[], object]) -> float:
    """Median seconds per call of ``fn`` (eager launches), the L2 flushed before each call."""
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) * 1e-3


def _bench_replay(fn: Callable[[], object]) -> float:
    """Median seconds per replay of a CUDA graph holding one call, the L2 flushed before each replay.

    Decode runs from graphs, so this leaves out the Python launch cost that dominates eager
    timing of a ~20 µs kernel, while still reading the weights from HBM, not from the L2 cache.
    """
    import torch

    fn()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _bench(graph.replay)


def _bench_graph(fn: Callable[[], object]) -> float:
    """Median seconds per call replaying a CUDA graph of back-to-back calls (no L2 flush)."""
    import triton

    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")) * 1e-3


def measure_bandwidth() -> float:
    """Bytes/s of a 2 GiB device copy, counting bytes read plus bytes written."""
    import torch

    src = torch.randn(2**29, device=DEVICE)  # 2 GiB of fp32
    dst = torch.empty_like(src)
    seconds = _bench(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / seconds


def measure_bf16_peak(size: int = 8192) -> float:
    """FLOP/s of a bf16 size³ ``torch.mm`` on random data (the decode attention's MMA type)."""
    import torch

    a = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    b = torch.randn(size, size, device=DEVICE, dtype=torch.bfloat16)
    seconds = _bench(lambda: torch.mm(a, b))
    return 2 * size**3 / seconds


def measure_fp8_peak(size: int = 8192) -> float:
    """FLOP/s of an e4m3 size³ ``torch._scaled_mm`` (tensor-wise scales, bf16 out) on random data."""
    import torch

    a = torch.randn(size, size, device=DEVICE).to(torch.float8_e4m3fn)
    b = torch.randn(size, size, device=DEVICE).to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants
    one = torch.ones((), device=DEVICE)
    seconds = _bench(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return 2 * size**3 / seconds


def sweep_configs(
    name: str, configs: list[dict[str, Any]], run: Callable[[dict[str, Any]], object]
) -> tuple[list[dict[str, Any]], tuple[float, dict[str, Any]] | None]:
    """Each launcher config timed as ``run(config)`` by graph replay: (every one tried, with its µs; the
    best as (seconds, config), or None). A config that fails (e.g. does not compile) is reported on
    stderr and skipped."""
    tried: list[dict[str, Any]] = []
    best: tuple[float, dict[str, Any]] | None = None
    for cfg in configs:
        try:
            t = _bench_replay(lambda c=cfg: run(c))
        except Exception as err:  # noqa: BLE001 - a config that does not compile is skipped
            print(
                f"  {name + ' ' if name else ''}config {cfg} failed: {type(err).__name__}: {str(err)[:120]}",
                file=sys.stderr,
            )
            continue
        tried.append({**cfg, "us": t * 1e6})
        if best is None or t < best[0]:
            best = (t, cfg)
    return tried, best


def _row(
    name: str,
    shape: str,
    seconds: float,
    nbytes: float,
    flops: float,
    ceil: dict[str, float],
    torch_seconds: float | None,
    note: str = "",
    peak: str = "fp8_peak",
) -> dict[str, object]:
    roofline = max(nbytes / ceil["bandwidth"], flops / ceil[peak])
    return {
        "kernel": name,
        "shape": shape,
        "us": seconds * 1e6,
        "tb_s": nbytes / seconds / 1e12,
        "tflop_s": flops / seconds / 1e12,
        "roofline_us": roofline * 1e6,
        "pct_roofline": 100 * roofline / seconds,
        "torch_us": None if torch_seconds is None else torch_seconds * 1e6,
        "torch_tb_s": None if torch_seconds is None else nbytes / torch_seconds / 1e12,
        "speedup_vs_torch": None if torch_seconds is None else torch_seconds / seconds,
        "note": note,
    }
