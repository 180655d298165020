"""The coldstart suite's results.jsonl as tables: each start's time to ready broken into its phases (and the Triton
compile seconds inside them), then TTFT on the fresh server against the warmed one.

    python3 scripts/gpu/coldstart_table.py out/coldstart/results.jsonl
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    ups = {r["start"]: r for r in rows if r.get("what") == "time_to_ready_s"}
    ready = {r["start"]: r for r in rows if r.get("event") == "ready"}
    stopped = {r["start"]: r for r in rows if r.get("event") == "stopped"}
    print(
        "start | up wall s | engine process s | loading | profiling (compiling in it) | compiling | capturing "
        "(compiling in it) | compiled after ready"
    )
    for start in dict.fromkeys([*ups, *ready]):  # every start, in order; one that never got ready says so
        event, up = ready.get(start), ups.get(start, {})
        if event is None:
            print(f"{start} | {up.get('seconds', '?')} | no ready event (up's exit code {up.get('rc', '?')})")
            continue
        phases, compiles = event.get("startup_s", {}), event.get("compiles", {})

        def cell(phase: str) -> str:
            inside = compiles.get(phase, {})
            extra = f" ({inside['compile_s']:.1f} s, {inside['num_compiled']} variants)" if inside else ""
            return f"{phases.get(phase, 0):.1f}{extra}"

        after = stopped.get(start, {}).get("compiles", {}).get("after_ready", {})
        print(
            f"{start} | {up.get('seconds', '?')} | {event.get('process_s', '?')} | {cell('loading')} | "
            f"{cell('profiling')} | {cell('compiling')} | {cell('capturing')} | "
            f"{after.get('num_compiled', 0)} ({after.get('compile_s', 0):.1f} s)"
        )
    loads = [r for r in rows if "server" in r and "ttft_ms_p50" in r]
    if loads:
        print("server | concurrency | prompt tokens | requests | TTFT p50 ms | TTFT p99 ms")
        for r in loads:
            print(
                f"{r['server']} | {r['concurrency']} | {r['prompt_tokens']} | {r['ok']}/{r['num_requests']} | "
                f"{r['ttft_ms_p50']} | {r['ttft_ms_p99']}"
            )
    for r in rows:
        if r.get("what") == "capture":
            print(f"capture {r['order']}, pool {r['pool']}: {r['total_s']} s, {r['graph_mib']} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
