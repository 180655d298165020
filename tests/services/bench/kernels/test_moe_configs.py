"""services/bench/kernels/moe_configs.py at toy sizes on CPU (the kernels interpreted, the timer replaced): the
rows in order, a config chosen only past MIN_GAIN and only with the defaults' bits, the launcher's defaults
recorded elsewhere."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kernels import moe_configs
from kernels.interpret import interpreter, load_interpreted
from services.bench.kernels import decode_gemms
from services.bench.kernels import moe_configs as bench

FAST = {"num_warps": 8, "num_stages": 4, "programs_per_sm": 1}  # 10% faster than the defaults
NEAR = {"num_warps": 4, "num_stages": 5, "programs_per_sm": 1}  # 1% faster: under MIN_GAIN
WRONG = {"num_warps": 4, "num_stages": 3, "programs_per_sm": 4}  # the fastest, but its output is perturbed


@pytest.fixture
def toy(monkeypatch):
    gemm = load_interpreted("moe_grouped_gemm")
    monkeypatch.setitem(sys.modules, "kernels.moe_grouped_gemm", gemm)
    monkeypatch.setitem(sys.modules, "kernels.quant_fp8", load_interpreted("quant_fp8"))
    real = gemm.moe_grouped_gemm

    def perturbed(*args, **kwargs):  # WRONG's launches write one slot's value off by one
        out = real(*args, **kwargs)
        if kwargs.get("programs_per_sm") == 4:
            values = out[1] if isinstance(out, tuple) else out  # the e4m3 pair's fp32 scales
            values[(0,) * values.ndim] += 1
        return out

    monkeypatch.setattr(gemm, "moe_grouped_gemm", perturbed)
    times = {None: 1e-3, 8: 0.9e-3, 5: 0.99e-3, 3: 0.5e-3}  # by the tag each timed call sets

    def replay(fn):
        fn()
        return times[replay.stages]

    replay.stages = None
    replay.times = times
    monkeypatch.setattr(bench, "_bench_replay", lambda fn: replay(fn))
    for module in (bench, decode_gemms):
        monkeypatch.setattr(module, "DEVICE", "cpu")
    from services.bench import harness as kernel_timing

    monkeypatch.setattr(kernel_timing, "DEVICE", "cpu")
    for name, value in (("EXPERTS", 8), ("TOP_K", 2)):
        monkeypatch.setattr(decode_gemms, name, value)
    monkeypatch.setattr(bench, "EXPERTS", 8)
    monkeypatch.setattr(bench, "HIDDEN", 256)
    monkeypatch.setattr(bench, "INTER", 128)
    monkeypatch.setattr(bench, "WO_A_GROUPS", 2)
    monkeypatch.setattr(bench, "WO_A_RANK", 128)
    monkeypatch.setattr(bench, "WO_A_IN", 256)
    monkeypatch.setattr(bench, "QUICK_MOE_TOKENS", (1, 40))  # 40: the shared expert in launches of its own
    monkeypatch.setattr(bench, "QUICK_WO_A_TOKENS", (20,))
    monkeypatch.setattr(bench, "CONFIGS", [FAST, NEAR, WRONG])
    return replay


def tag_calls(monkeypatch, replay):
    """Each swept call tells the timer which config it runs."""
    real_problems = bench._problems

    def timed_problems(*args):  # each call tells the timer which config it runs
        out = []
        for name, t, key, call, nbytes, block_m in real_problems(*args):

            def timed(call=call, **config):
                replay.stages = {4: 8, 5: 5, 3: 3}.get(config.get("num_stages"))
                return call(**config)

            out.append((name, t, key, timed, nbytes, block_m))
        return out

    monkeypatch.setattr(bench, "_problems", timed_problems)


def test_rows_and_table_at_toy_sizes(toy, monkeypatch):
    tag_calls(monkeypatch, toy)
    ceil = {"bandwidth": 4e12, "fp8_peak": 1e15}
    with interpreter():
        rows, table = bench.sweep(ceil, True, torch.Generator().manual_seed(0))
    names = [r["kernel"] for r in rows]
    per_layer = [
        "moe gate/up+swiglu [defaults]",
        "moe gate/up+swiglu [best of 3]",
        "moe down [defaults]",
        "moe down [best of 3]",
    ]
    apart = [
        n.replace("moe gate/up+swiglu", "moe gate/up+swiglu routed").replace("moe down", "moe down routed")
        for n in per_layer
    ] + [
        n.replace("moe gate/up+swiglu", "moe gate/up+swiglu shared").replace("moe down", "moe down shared")
        for n in per_layer
    ]
    assert names == per_layer + apart + ["attention wo_a (grouped) [defaults]", "attention wo_a (grouped) [best of 3]"]
    best_notes = [r["note"] for r in rows[1::2]]
    assert all(n.startswith(str(FAST)) and "BITS DIFFER" in n and str(WRONG) in n for n in best_notes), best_notes
    assert moe_configs.ENV not in os.environ  # the sweep put the switch back
    # FAST (10%) is chosen everywhere; WRONG, faster still, never is.
    assert all(c == FAST for by_tokens in table.values() for c in by_tokens.values())
    assert sum(len(v) for v in table.values()) == len(rows) // 2


def test_a_gain_under_min_gain_records_the_launchers_defaults(toy, monkeypatch):
    tag_calls(monkeypatch, toy)
    toy.times[8] = (1 - bench.MIN_GAIN / 2) * toy.times[None]
    monkeypatch.setattr(bench, "QUICK_MOE_TOKENS", ())
    with interpreter():
        rows, table = bench.sweep({"bandwidth": 4e12, "fp8_peak": 1e15}, True, torch.Generator().manual_seed(0))
    (entries,) = table.values()
    assert entries == {"20": bench.launcher_defaults(16, False)} and "1.02× the defaults" in rows[1]["note"]
