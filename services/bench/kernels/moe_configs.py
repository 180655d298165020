"""`shinkai bench kernels --only moe_configs`: the MoE grouped GEMM's launch configs (warps, pipeline stages,
programs per SM) swept on v41-s1's calls of it as the engine makes them, the table ``kernels/moe_configs.py``
reads.

The calls: the MoE layer's gate/up + SwiGLU and down GEMMs (48 routed experts, top-6, the shared expert stacked
last; in their own routed and shared launches where ``moe_experts`` splits them) at decode batches, and attention's
grouped ``wo_a`` (8 groups, 4,096 → 1,024) below ``block_scaled_gemm.GROUPED_MIN_TOKENS``. Each config is timed
as a graph replay against the launcher's defaults (the table switched off) on the same operands, and its output
is compared bit for bit with the defaults' (a mismatch is reported and the config never chosen: the table's
promise is that no config changes the result). A config is chosen only where it beats the defaults by
``MIN_GAIN``; elsewhere the table records the launcher's defaults, so a neighbouring size's entry is not taken there.

    python -m services.bench.kernels.moe_configs --write-configs kernels/configs/<file> --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any
from unittest import mock

from services.bench.harness import DEVICE, _bench_replay, _row
from services.bench.kernels.decode_gemms import layer_meta
from services.bench.kernels.run import EXPERTS, HIDDEN, INTER, SWIGLU_LIMIT, _random_weights

if TYPE_CHECKING:
    import torch

MOE_TOKENS = (1, 4, 16, 64, 128, 256)
WO_A_TOKENS = (1, 16, 64, 256, 1024, 2048)
QUICK_MOE_TOKENS, QUICK_WO_A_TOKENS = (1, 64, 256), (64, 1024)
WO_A_GROUPS, WO_A_RANK, WO_A_IN = 8, 1024, 4096  # v41-s1's o_groups, o_lora_rank, n_heads·head_dim / groups
CONFIGS = [dict(num_warps=w, num_stages=s, programs_per_sm=p) for w in (4, 8) for s in (3, 4, 5) for p in (1, 2, 4)]
SENTINEL = -7.0  # what the output buffers hold before a checked call
MIN_GAIN = 0.03  # a config must be this much faster than the defaults to be chosen (above replay noise)


def _problems(
    tokens_moe: tuple[int, ...], tokens_wo_a: tuple[int, ...], gen: torch.Generator
) -> list[tuple[str, int, str, Callable[..., Any], float, int]]:
    """(name, tokens, table key, call(**config) → output, weight bytes, BLOCK_M) of every GEMM call swept."""
    import torch

    from kernels import moe_configs
    from kernels.moe_grouped_gemm import (
        _experts_of,
        default_block_m,
        empty_output,
        moe_grouped_gemm,
        shared_apart,
        split_shared,
    )
    from kernels.quant_fp8 import IN_GEMM_MAX_ROWS, quantize_act
    from services.worker.kernel_model.fp8_linear import group_rows_meta, linear_block_m

    problems = []
    stacked = EXPERTS + 1
    w13, s13 = _random_weights(2 * INTER, HIDDEN, gen, stacked)
    w2, s2 = _random_weights(HIDDEN, INTER, gen, stacked)
    for t in tokens_moe:
        meta = layer_meta(t, gen)
        x = torch.randn(t, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        a = quantize_act(x) if t > IN_GEMM_MAX_ROWS else x
        block_m = default_block_m(meta["slot_of"].numel() / stacked)
        capacity = meta["row_ids"].shape[1]
        h = moe_grouped_gemm(
            a, w13, s13, meta, gather=True, swiglu_limit=SWIGLU_LIMIT, out_dtype=torch.float8_e4m3fn, block_m=block_m
        )
        parts = [("", slice(None), meta)]
        if shared_apart(capacity, block_m):
            routed, shared = split_shared(meta)
            parts = [(" routed", slice(0, -1), routed), (" shared", slice(-1, None), shared)]
        for label, experts, part in parts:
            num = len(range(stacked)[experts])
            active = min(num, int(part["num_active"]))
            for name, w, s, inp, gather, swiglu, out_dtype in (
                ("moe gate/up+swiglu", w13, s13, a, True, SWIGLU_LIMIT, torch.float8_e4m3fn),
                ("moe down", w2, s2, _experts_of(h, experts), False, None, torch.bfloat16),
            ):
                out = empty_output(num, capacity, w.shape[1] // (2 if swiglu else 1), out_dtype, x.device)

                def call(
                    w=w[experts],
                    s=s[experts],
                    inp=inp,
                    gather=gather,
                    swiglu=swiglu,
                    out_dtype=out_dtype,
                    part=part,
                    out=out,
                    **config,
                ):
                    return moe_grouped_gemm(
                        inp,
                        w,
                        s,
                        part,
                        gather=gather,
                        swiglu_limit=swiglu,
                        out_dtype=out_dtype,
                        block_m=block_m,
                        out=out,
                        **config,
                    )

                key = moe_configs.shape_key(
                    num,
                    w.shape[1],
                    w.shape[2],
                    swiglu=swiglu is not None,
                    a_fp8=isinstance(inp, tuple),
                    out_dtype=out_dtype,
                )
                weight_bytes = active * w.shape[1] * w.shape[2] * (1 + 4 / 128**2)
                problems.append((name + label, t, key, call, weight_bytes, block_m))
    w_o, s_o = _random_weights(WO_A_RANK, WO_A_IN, gen, WO_A_GROUPS)
    for t in tokens_wo_a:
        x = torch.randn(t * WO_A_GROUPS, WO_A_IN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        a = quantize_act(x) if t > IN_GEMM_MAX_ROWS else x
        meta = group_rows_meta(t, WO_A_GROUPS, x.device)
        out = torch.zeros(t, WO_A_GROUPS, WO_A_RANK, dtype=torch.bfloat16, device=x.device).transpose(0, 1)

        def call(a=a, meta=meta, out=out, t=t, **config):
            return moe_grouped_gemm(
                a, w_o, s_o, meta, gather=True, out_dtype=torch.bfloat16, block_m=linear_block_m(t), out=out, **config
            )

        key = moe_configs.shape_key(
            WO_A_GROUPS, WO_A_RANK, WO_A_IN, swiglu=False, a_fp8=isinstance(a, tuple), out_dtype=torch.bfloat16
        )
        weight_bytes = WO_A_GROUPS * WO_A_RANK * WO_A_IN * (1 + 4 / 128**2)
        problems.append(("attention wo_a (grouped)", t, key, call, weight_bytes, linear_block_m(t)))
    return problems


def outputs(call: Callable[..., Any], **config: int) -> list[torch.Tensor]:
    """Copies of the output tensors (both halves of the e4m3 pair) of ``call(**config)``, its buffers first filled
    with a value no call writes there unless it computed it, so a config that leaves slots unwritten differs."""
    buffers = call()
    for buffer in buffers if isinstance(buffers, tuple) else (buffers,):
        buffer.fill_(SENTINEL)
    out = call(**config)
    return [o.clone() for o in out] if isinstance(out, tuple) else [out.clone()]


def sweep(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> tuple[list[dict[str, Any]], dict]:
    """The rows (defaults, then the best config, per call) and the table {key: {tokens: config}}."""
    from kernels import moe_configs

    with mock.patch.dict(os.environ, {moe_configs.ENV: "0"}):  # "defaults": the launcher's, not an earlier table's
        return _sweep(ceil, quick, gen)


def _sweep(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> tuple[list[dict[str, Any]], dict]:
    import torch

    rows: list[dict[str, Any]] = []
    table: dict[str, dict[str, dict[str, int]]] = {}
    problems = _problems(QUICK_MOE_TOKENS if quick else MOE_TOKENS, QUICK_WO_A_TOKENS if quick else WO_A_TOKENS, gen)
    for name, t, key, call, weight_bytes, block_m in problems:
        want = outputs(call)
        base = _bench_replay(call)
        best: tuple[float, dict[str, int]] | None = None
        mismatched = []
        for config in CONFIGS:
            try:
                got = outputs(call, **config)
                seconds = _bench_replay(lambda c=config: call(**c))
            except Exception as err:  # noqa: BLE001 - a config that does not compile or launch is skipped
                print(f"  {name} T={t} {config} failed: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
                continue
            if not all(torch.equal(g, w) for g, w in zip(got, want)):
                mismatched.append(config)
                continue
            if best is None or seconds < best[0]:
                best = (seconds, config)
        shape = f"T={t} {key}"
        rows.append(_row(f"{name} [defaults]", shape, base, weight_bytes, 0.0, ceil, None, "table off"))
        chosen = None
        if best is not None:
            rows.append(
                _row(
                    f"{name} [best of {len(CONFIGS)}]",
                    shape,
                    best[0],
                    weight_bytes,
                    0.0,
                    ceil,
                    None,
                    f"{best[1]}; {base / best[0]:.2f}× the defaults",
                )
            )
            if best[0] < (1 - MIN_GAIN) * base:
                chosen = best[1]
        if mismatched:
            rows[-1]["note"] += f"; BITS DIFFER for {mismatched}"
        table.setdefault(key, {})[str(t)] = chosen or launcher_defaults(block_m, " swiglu " in key)
    return rows, table


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    return sweep(ceil, quick, gen)[0]


def main(argv: list[str] | None = None) -> int:
    import torch

    from services.bench import harness as timing
    from services.bench.kernels.run import print_table

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--write-configs", help="merge the measured table into this JSON (kernels/configs/...)")
    parser.add_argument("--json", dest="json_path", help="the rows as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_moe_configs: no CUDA device; nothing was measured.", file=sys.stderr)
        return 3
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    ceil = {"bandwidth": timing.measure_bandwidth(), "fp8_peak": timing.measure_fp8_peak()}
    rows, table = sweep(ceil, args.quick, gen)
    print_table(rows)
    if args.json_path:
        Path(args.json_path).write_text(
            json.dumps({"device": torch.cuda.get_device_name(), "rows": rows, "table": table}, indent=1)
        )
    if args.write_configs:
        path = Path(args.write_configs)
        merged = json.loads(path.read_text()) if path.is_file() else {}
        merged.update(table)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path}")
    return 0


def launcher_defaults(block_m: int, swiglu: bool) -> dict[str, int]:
    """The fields the launcher uses without a table: its warps rule at the call's BLOCK_M, its stages and programs."""
    from kernels.moe_grouped_gemm import DEFAULT_NUM_STAGES, DEFAULT_PROGRAMS_PER_SM, default_num_warps

    return {
        "num_warps": default_num_warps(128, block_m, swiglu),
        "num_stages": DEFAULT_NUM_STAGES,
        "programs_per_sm": DEFAULT_PROGRAMS_PER_SM,
    }


if __name__ == "__main__":
    sys.exit(main())
