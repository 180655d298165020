"""`shinkai bench step`'s Markdown: one table per section that ran, then any section's error."""

from __future__ import annotations

from typing import Any


def _floor_cells(r: dict[str, Any], floor_spec: str) -> str:
    """A row's floor and % of floor cells ("-" where no floor was measured)."""
    floor = "-" if r["floor_ms"] is None else format(r["floor_ms"], floor_spec)
    eff = "-" if r["efficiency"] is None else f"{100 * r['efficiency']:.1f}"
    return f"{floor} | {eff}"


def _launch_totals(r: dict[str, Any]) -> str:
    """The profile's totals over every kernel; rows from JSON written before they were recorded have none."""
    if "launches_per_step" not in r:
        return ""
    return (
        f"; {r['launches_per_step']:.0f} kernel launches per step, {r['kernel_ms']:.2f} ms in kernels, "
        f"{r['copies_per_step']:.0f} copies/fills {r['copy_ms']:.2f} ms"
    )


def markdown(result: dict[str, Any]) -> str:
    """The tables of a ``shinkai bench step`` result (``step._result``), one per section that ran."""
    lines = [f"`{result['command']}` on {result['device']}, {result['date']}", ""]
    dec = [r for r in result["rows"] if r["section"] == "decode"]
    if dec:
        lines += [
            "| experts | context | batch | step ms | floor ms | % of floor | tokens/s | × FP8 experts |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in dec:
            versus = f"{r['vs_fp8']:.2f}" if "vs_fp8" in r else "-"
            lines.append(
                f"| {r.get('expert_format') or '-'} | {r['context']} | {r['batch']} | {r['ms']:.2f} | "
                f"{_floor_cells(r, '.2f')} | {r['tokens_per_s']:.0f} | {versus} |"
            )
    for r in result["rows"]:
        if r["section"] == "decode fit":
            lines.append(f"\nfit at context {r['context']}: {r['a_ms']:.2f} ms + {r['b_us_per_row']:.1f} µs · rows")
    pre = [r for r in result["rows"] if r["section"] == "prefill"]
    if pre:
        lines += ["", "| prefill tokens | step ms | floor ms | % of floor |", "|---|---|---|---|"]
        for r in pre:
            lines.append(f"| {r['tokens']} | {r['ms']:.1f} | {_floor_cells(r, '.1f')} |")
    off = [r for r in result["rows"] if r["section"] == "offline"]
    if off:
        lines += ["", "| async | batch | tokens/s | GPU busy | GPU busy, decode steps |", "|---|---|---|---|---|"]
        for r in off:
            busy = "-" if r["gpu_busy"] is None else f"{100 * r['gpu_busy']:.1f}%"
            decode = "-" if r.get("decode_busy") is None else f"{100 * r['decode_busy']:.1f}%"
            lines.append(
                f"| {'on' if r['async'] else 'off'} | {r['batch']} | {r['tokens_per_s']:.1f} | {busy} | {decode} |"
            )
    inv = [r for r in result["rows"] if r["section"] == "batch-invariant"]
    if inv:
        lines += ["", "| batch-invariant | size | step ms, off | step ms, on | cost |", "|---|---|---|---|---|"]
        lines += [
            f"| {r['kind']} | {r.get('batch', r.get('tokens'))} | {r['ms_off']:.2f} | {r['ms_on']:.2f} | "
            f"{100 * r['cost']:+.0f}% |"
            for r in inv
        ]
    three = [r for r in result["rows"] if r["section"] == "three ways"]
    if three:
        lines += ["", "| way | batch | layers | step ms | scaled to full depth |", "|---|---|---|---|---|"]
        lines += [
            f"| {r['way']} | {r['batch']} | {r['layers']} | {r['ms']:.2f} | {r['ms_full_depth']:.1f} |" for r in three
        ]
    host = [r for r in result["rows"] if r["section"] == "host"]
    if host:
        lines += ["", "| host ms per decode step (device stubbed) | batch | sync | async |", "|---|---|---|---|"]
        lines += [f"| context {r['context']} | {r['batch']} | {r['sync_ms']:.2f} | {r['async_ms']:.2f} |" for r in host]
    for r in result["rows"]:
        if r["section"] == "profile":
            what = (
                f"prefill profile, {r['prefill_tokens']} tokens"
                if "prefill_tokens" in r
                else f"decode profile, batch {r['batch']} at {r['context']}"
            )
            lines += [
                "",
                f"{what}: {r['wall_ms']:.2f} ms per step "
                f"(profiled), device busy {r['busy_ms']:.2f} ms{_launch_totals(r)}",
                "",
                "| µs per step | launches | kernel |",
                "|---|---|---|",
            ]
            lines += [
                f"| {k['us_per_step']:.1f} | {k['launches_per_step']:.1f} | `{k['kernel'][:80]}` |"
                for k in r["kernels"]
            ]
    lines += [f"\n{r['section']}: {r['error']}" for r in result["rows"] if "error" in r]
    return "\n".join(lines) + "\n"
