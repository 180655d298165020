"""Print the compiled sparse decode attention kernels' resources (registers, spills, shared memory)
and the MMA / async-copy instructions in their PTX, at R=1 (split keys) and R=256 (one program per
row); run on the GPU machine (the ``kernels`` suite of ``scripts/gpu/run.sh``).

``--offline`` (no GPU): compile the kernel for sm_90a here at the Flash shapes of each launch kind,
with the argument specialisation Triton applies on the GPU (16-divisible pointers and strides —
without it, as in a plain ``scripts/dev/compile_sm90.py`` call, the key loads neither vectorise nor
pipeline and ptxas reports ~1 KB of spills that the real kernel does not have), and print ptxas's
registers and spills.

``--time``: also time the kernel alone (graph replay, L2 flushed, as the benchmark) at R = 1, 64, 256
for 4K and 32K context, against the roofline with the ceilings given (the last full run's by default)
— a short device call, without the benchmark's slow torch baselines.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch

import kernels.decode_attention as da
from services.bench.harness import _bench_replay
from services.bench.kernels.decode_attention import decode_attention_args, decode_attention_problem

parser = argparse.ArgumentParser()
parser.add_argument("out", nargs="?", help="ignored (the kernels suite passes its output folder)")
parser.add_argument("--offline", action="store_true")
parser.add_argument("--time", action="store_true")
parser.add_argument("--bandwidth", type=float, default=4.27e12, help="HBM bytes/s (a full H200 run's)")
parser.add_argument("--bf16-peak", type=float, default=680e12, help="bf16 FLOP/s (same run)")
args = parser.parse_args()

if args.offline:
    import triton
    from triton.compiler import ASTSource

    from scripts.dev.compile_sm90 import TARGET, ptxas_report

    fn = da._decode_attention_kernel
    sig = dict(
        q_ptr="*bf16",
        ring_ptr="*u8",
        slots_ptr="*i64",
        pos_ptr="*i64",
        pool_ptr="*u8",
        sel_ptr="*i32",
        sink_ptr="*fp32",
        freqs_ptr="*fp32",
        out_ptr="*bf16",
        part_acc_ptr="*fp32",
        part_ml_ptr="*fp32",
        **{name: "i32" for name in fn.arg_names[11:23]},
        scale_log2e="fp32",
    )
    # Flash: every pointer and stride but the state slot's (2,916,132 B) and the ring size (134) is 16-divisible.
    div16 = [name for name in sig if name not in ("ring_stride_slot", "ring_size", "scale_log2e")]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in div16}
    # (KEYS, BLOCK_N, SPLITS, BLOCKS_PER_SPLIT): whole rows, R = 8 (10 splits), R = 1 (one block each).
    for keys, block_n, splits, per_split in ((0, 64, 1, 10), (1, 32, 10, 2), (2, 32, 10, 2), (3, 32, 20, 1)):
        consts = dict(
            WINDOW=128,
            TOPK=512,
            D=512,
            ROPE_PAIRS=32,
            BLOCK_H=64,
            BLOCK_N=block_n,
            SPLITS=splits,
            BLOCKS_PER_SPLIT=per_split,
            KEYS=keys,
            RING_ALIGN=4,
            NUM_STAGES=3,
            DOT_FP32=False,
            LIBDEVICE=True,
        )
        src = ASTSource(
            fn=fn,
            signature={**sig, **{k: "constexpr" for k in consts}},
            constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()},
            attrs=attrs,
        )
        kernel = triton.compile(src, target=TARGET, options={"num_warps": 8, "num_stages": 3})
        print(f"KEYS={keys} BLOCK_N={block_n} SPLITS={splits}: shared {kernel.metadata.shared} B")
        print(ptxas_report(kernel.asm["ptx"]))
    sys.exit(0)

compiled = []
for fn in (da._decode_attention_kernel, da._combine_kernel):

    def _record(*a, _run=fn.run, **kw):
        kernel = _run(*a, **kw)
        compiled.append(kernel)
        return kernel

    fn.run = _record
gen = torch.Generator("cuda").manual_seed(0)
for rows in (1, 256):
    compiled.clear()
    da.sparse_decode_attention(*decode_attention_args(decode_attention_problem(rows, 4096, gen)))
    torch.cuda.synchronize()
    for k in compiled:
        ptx = k.asm.get("ptx", "")
        ops = sorted(set(re.findall(r"\b(wgmma\.\w+|mma\.sync\.\w+|cp\.async\.bulk\.\w+|cp\.async\.\w+)", ptx)))
        print(f"R={rows}: {k.name} regs={k.n_regs} spills={k.n_spills} shared={k.metadata.shared} ops={ops}")
if args.time:
    for context in (4096, 32768):
        for rows in (1, 64, 256):
            p = decode_attention_problem(rows, context, gen)
            a, out = decode_attention_args(p), torch.empty_like(p["q"])
            heads, hd = p["q"].shape[1:]
            window, topk = p["window"], p["selected"].shape[1]
            nbytes = rows * (2 * heads * hd * 2 + window * (hd + hd // 32) + topk * (hd // 2 + hd // 16 + 4) + 16)
            flops = 4.0 * rows * heads * hd * (window + topk)
            floor = max(nbytes / args.bandwidth, flops / args.bf16_peak)
            t = _bench_replay(lambda a=a, out=out: da.sparse_decode_attention(*a, out=out))
            print(
                f"R={rows} ctx={context}: {t * 1e6:.1f} us, roofline {floor * 1e6:.1f} us, "
                f"{100 * floor / t:.1f}% of roofline",
                flush=True,
            )
            if context != 32768 or rows == 1:
                continue
            variants = [dict(block_n=64, num_stages=2), dict(block_n=32, num_stages=3), dict(block_n=32, num_stages=4)]
            variants += [dict(splits=1)] if rows < 132 else []
            for kw in variants:
                t = _bench_replay(lambda a=a, out=out, kw=kw: da.sparse_decode_attention(*a, out=out, **kw))
                print(f"  {kw}: {t * 1e6:.1f} us", flush=True)
            alone = {"window only": (*a[:6], p["selected"][:, :0], *a[7:]), "entries only": (*a[:4], 0, *a[5:])}
            for label, v in alone.items():
                t = _bench_replay(lambda v=v, out=out: da.sparse_decode_attention(*v, out=out))
                print(f"  {label}: {t * 1e6:.1f} us", flush=True)
