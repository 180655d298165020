"""Time the one-expert FP8 GEMM (``KernelLinear``'s path) at v41-s1's projection shapes over token
counts and tile configs, on the GPU: which BLOCK_M / warps each token count wants.

    python scripts/diagnostics/tune_linear.py [--tokens 1,64,256,1024,4096] [--json out.json]

Weights are random e4m3 with unit scales (timing only); activations are pre-quantised as
``KernelLinear`` hands them in. Prints µs, TB/s of weight bytes, TFLOP/s per config and the best.
Launches run back to back: below ~1K tokens this times the host's launch cost, not the GEMM;
``shinkai bench kernels --only decode_gemms`` times those sizes as graph replays.
"""

from __future__ import annotations

import argparse
import json

import torch

from kernels import moe_grouped_gemm as gg
from kernels.quant_fp8 import quantize_act
from services.bench.kernels.decode_gemms import projection_shapes
from services.worker.kernel_model.fp8_linear import one_expert_meta

CONFIGS = ((16, 4), (32, 4), (32, 8), (64, 8), (128, 8))  # (BLOCK_M, num_warps)


def time_us(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", default="1,64,256,1024,4096")
    p.add_argument("--json")
    args = p.parse_args()
    dev = torch.device("cuda")
    rows = []
    for label, (n, k) in projection_shapes().items():
        w = torch.randn(1, n, k, device=dev).clamp(-8, 8).to(torch.float8_e4m3fn)
        w_scale = torch.ones(1, n // 128, k // 128, device=dev)
        for m in (int(t) for t in args.tokens.split(",")):
            a = quantize_act(torch.randn(m, k, device=dev, dtype=torch.bfloat16))
            meta = one_expert_meta(m, 1, dev)
            best = None
            for bm, nw in CONFIGS:
                if bm > 16 and bm > 2 * m:
                    continue
                us = time_us(lambda: gg.moe_grouped_gemm(a, w, w_scale, meta, gather=True, block_m=bm, num_warps=nw))
                tbs, tflops = n * k / us * 1e-6, 2 * m * n * k / us * 1e-6
                rows.append(
                    {
                        "linear": label,
                        "n": n,
                        "k": k,
                        "tokens": m,
                        "block_m": bm,
                        "num_warps": nw,
                        "us": us,
                        "tb_s": tbs,
                        "tflop_s": tflops,
                    }
                )
                print(
                    f"{label:18} N {n:6} K {k:5} T {m:5} BM {bm:3} w{nw}: {us:9.1f} µs {tbs:6.2f} TB/s "
                    f"{tflops:7.1f} TFLOP/s",
                    flush=True,
                )
                best = min(best or (us, bm, nw), (us, bm, nw))
            print(f"  best at T {m}: BM {best[1]} w{best[2]} {best[0]:.1f} µs")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
