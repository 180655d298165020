#!/usr/bin/env bash
# Issue 23's ctx-32K decode regression, per kernel: `bench step --profile` at batch 1 and one context (32K by
# default) for the commit before expert parallelism (parent/) and HEAD, then their kernel tables side by
# side (µs per decode step, launches per step, head − parent), and the profiled step's wall and device-busy
# time: a kernel that grew names the device-side cause; a wall that grew with an unchanged busy time points
# at host work between the kernels. One device call, about 2 minutes. Needs the parent's source in parent/
# (carry it with the device call), as scripts/gpu_dp1_speed.sh:
#   rm -rf parent && mkdir parent && git archive d088b4c | tar -x -C parent && cp scheduler_rs/_core.abi3.so parent/scheduler_rs/
# CONTEXTS=4096 (or "4096,32768": the profile takes the first) profiles another context. Results land in
# $OUT (or ./out): parent.log/json, head.log/json and the side-by-side table in compare.txt.
set -uo pipefail
. scripts/device_env.sh
args="--layers ${LAYERS:-8} --no-compare --no-async --batches 1 --contexts ${CONTEXTS:-32768} --prefill-tokens 1024 --profile"
(cd parent && PYTHONPATH="$PWD:$site" timeout 110 python3 -m services.bench.step $args --json "$out/parent.json" \
    > "$out/parent.log" 2>&1) || echo "parent run: exit $?"
PYTHONPATH="$PWD:$site" timeout 110 python3 -m services.bench.step $args --json "$out/head.json" > "$out/head.log" 2>&1 \
    || echo "head run: exit $?"
grep -H "decode  ctx\|prefill  \|^profile" "$out/parent.log" "$out/head.log"
python3 - "$out/parent.json" "$out/head.json" <<'EOF' | tee "$out/compare.txt"
import json
import sys


def profiles(path):
    """(the decode profile row, the prefill profile row) of one run's JSON; None where it has none."""
    try:
        rows = json.load(open(path))["rows"]
    except (OSError, ValueError, KeyError) as err:
        print(f"{path}: no result ({err})")
        return None, None
    found = [r for r in rows if r.get("section") == "profile"]
    decode = next((r for r in found if "prefill_tokens" not in r), None)
    prefill = next((r for r in found if "prefill_tokens" in r), None)
    return decode, prefill


def side_by_side(title, parent, head):
    if parent is None or head is None:
        print(f"{title}: missing in {'parent' if parent is None else 'head'}")
        return
    print(f"\n{title}: wall {parent['wall_ms']:.3f} -> {head['wall_ms']:.3f} ms per step "
          f"({head['wall_ms'] - parent['wall_ms']:+.3f}), device busy {parent['busy_ms']:.3f} -> "
          f"{head['busy_ms']:.3f} ms ({head['busy_ms'] - parent['busy_ms']:+.3f})")
    p = {k["kernel"]: k for k in parent["kernels"]}  # each run's top kernels by time
    h = {k["kernel"]: k for k in head["kernels"]}
    def us(run, name):
        return run[name]["us_per_step"] if name in run else 0.0

    # A kernel in one table only may sit below the other run's top rows: its |delta| is at most the shown one (≤).
    names = sorted(set(p) | set(h), key=lambda n: -abs(us(h, n) - us(p, n)))
    print(f"{'parent us':>10} {'head us':>10} {'delta':>10} {'launches p/h':>13}  kernel (by |delta|; '-': not in "
          "that run's top rows)")
    for n in names:
        cells = []
        for run, key, spec in ((p, "us_per_step", ".1f"), (h, "us_per_step", ".1f")):
            cells.append(format(run[n][key], spec) if n in run else "-")
        mark = "" if n in p and n in h else "≤"
        launches = "/".join(format(run[n]["launches_per_step"], ".1f") if n in run else "-" for run in (p, h))
        print(f"{cells[0]:>10} {cells[1]:>10} {mark + format(us(h, n) - us(p, n), '+.1f'):>10} {launches:>13}  "
              f"{n[:100]}")

(pd, pp), (hd, hp) = profiles(sys.argv[1]), profiles(sys.argv[2])
side_by_side(f"decode ctx {hd and hd.get('context')} batch {hd and hd.get('batch')}", pd, hd)
side_by_side("prefill", pp, hp)
EOF
