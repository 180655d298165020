"""Two ``bench step --profile`` runs side by side: each kernel's µs per step and launches per step in the
baseline and the head run, the delta (head − baseline) sorted by size, and the profiled step's wall and
device-busy time. A kernel that grew names the device-side cause; a wall that grew with an unchanged busy
time points at host work between the kernels. The ``compare-profile`` suite of scripts/gpu/run.sh calls it:

    python3 scripts/gpu/compare_profiles.py BASE.json HEAD.json
"""

import json
import sys


def profiles(path):
    """(the decode profile row, the prefill profile row) of one run's JSON; None where it has none."""
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError) as err:
        print(f"{path}: no result ({err})")
        return None, None
    found = [r for r in rows if r.get("section") == "profile"]
    decode = next((r for r in found if "prefill_tokens" not in r), None)
    prefill = next((r for r in found if "prefill_tokens" in r), None)
    return decode, prefill


def side_by_side(title, base, head):
    if base is None or head is None:
        print(f"{title}: missing in {'base' if base is None else 'head'}")
        return
    print(
        f"\n{title}: wall {base['wall_ms']:.3f} -> {head['wall_ms']:.3f} ms per step "
        f"({head['wall_ms'] - base['wall_ms']:+.3f}), device busy {base['busy_ms']:.3f} -> "
        f"{head['busy_ms']:.3f} ms ({head['busy_ms'] - base['busy_ms']:+.3f})"
    )
    p = {k["kernel"]: k for k in base["kernels"]}  # each run's top kernels by time
    h = {k["kernel"]: k for k in head["kernels"]}

    def us(run, name):
        return run[name]["us_per_step"] if name in run else 0.0

    # A kernel in one table only may sit below the other run's top rows: its |delta| is at most the shown one (≤).
    names = sorted(set(p) | set(h), key=lambda n: -abs(us(h, n) - us(p, n)))
    print(
        f"{'base us':>10} {'head us':>10} {'delta':>10} {'launches b/h':>13}  kernel (by |delta|; '-': not in "
        "that run's top rows)"
    )
    for n in names:
        cells = []
        for run, key, spec in ((p, "us_per_step", ".1f"), (h, "us_per_step", ".1f")):
            cells.append(format(run[n][key], spec) if n in run else "-")
        mark = "" if n in p and n in h else "≤"
        launches = "/".join(format(run[n]["launches_per_step"], ".1f") if n in run else "-" for run in (p, h))
        print(
            f"{cells[0]:>10} {cells[1]:>10} {mark + format(us(h, n) - us(p, n), '+.1f'):>10} {launches:>13}  {n[:100]}"
        )


(pd, pp), (hd, hp) = profiles(sys.argv[1]), profiles(sys.argv[2])
side_by_side(f"decode ctx {hd and hd.get('context')} batch {hd and hd.get('batch')}", pd, hd)
side_by_side("prefill", pp, hp)
