"""`shinkai bench step`'s offline section: the same prompts generated with async scheduling off and
on, tokens/s from an unprofiled run (with its host ms per decode step by phase, ``step_phases``), and
the GPU-busy fraction (kernel time from a profiled rerun over the unprofiled wall time). ``decode_busy`` is the busy
fraction of the decode steps alone: on the profiled run's device timeline, from the end of the last prefill attention
kernel to the end of the last kernel, the union of kernel intervals over that window (prefill steps run eagerly and are
not what async scheduling overlaps)."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from services.bench.step.phases import StepPhases, describe


def offline_section(build, cfg, batch: int, steps: int) -> list[dict[str, Any]]:
    import torch

    from services.engine import SamplingParams

    rows = []
    for flag in (False, True):
        llm = build(max_num_seqs=batch, max_model_len=256, async_scheduling=flag)
        prompts = [
            torch.randint(3, cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(i)).tolist()
            for i in range(batch)
        ]
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        # Warm-up on the same prompts: the prefill chunks' shapes compile here, not in the timed run
        # (a one-prompt warm-up left them to the first timed run, which then timed their compilation).
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        busy = kernel_s = profiled_wall = decode_busy = None
        phases = StepPhases()  # host ms per decode step by phase (microseconds of clock overhead per step)
        phases.attach(llm.engine)
        t0 = time.perf_counter()
        try:
            outs = llm.generate(prompts, params)  # tokens/s without the profiler's overhead
        finally:
            phases.detach()
        wall = time.perf_counter() - t0
        split = phases.summary()
        if torch.cuda.is_available():
            # Kernel time from a second, profiled run of the same work (the same kernels), over the
            # unprofiled run's wall time: the profiler slows the host, not the device.
            from torch.profiler import ProfilerActivity, profile

            t1 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, params)
            profiled_wall = time.perf_counter() - t1
            kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
            kernel_s = 1e-6 * sum(e.device_time for e in kernels)
            busy = min(1.0, kernel_s / wall)
            decode_busy = decode_window_busy([(e.time_range.start, e.time_range.end, e.name) for e in kernels])
        tokens = sum(len(o.token_ids) for o in outs)
        rows.append(
            {
                "section": "offline",
                "async": flag,
                "batch": batch,
                "tokens": tokens,
                "seconds": wall,
                "tokens_per_s": tokens / wall,
                "gpu_busy": busy,
                "kernel_s": kernel_s,
                "decode_busy": decode_busy,
                "profiled_seconds": profiled_wall,
                "host_ms": split,
            }
        )
        print(
            f"offline async={'on ' if flag else 'off'} batch {batch}: {tokens / wall:9.1f} tokens/s"
            + (
                f"  GPU busy {100 * busy:.1f}% (kernels {kernel_s:.2f} s, wall {wall:.2f} s, profiled wall "
                f"{profiled_wall:.2f} s)"
                if busy is not None
                else ""
            )
            + (f", decode steps busy {100 * decode_busy:.1f}%" if decode_busy is not None else "")
        )
        if split:
            print(f"        host ms per decode step (median of {len(phases.samples)}): {describe(split)}")
        del llm
    return rows


def decode_window_busy(
    kernels: list[tuple[float, float, str]], prefill_kernel: str = "_prefill_attention_kernel"
) -> float | None:
    """Busy fraction of the window after the last ``prefill_kernel`` ends: kernels as (start, end, name) on
    one clock; overlapping kernels (several streams) count once. None when no kernel runs after it."""
    prefill_ends = [end for _, end, name in kernels if name == prefill_kernel]
    start = max(prefill_ends) if prefill_ends else min((s for s, _, _ in kernels), default=None)
    after = sorted((max(s, start), e) for s, e, _ in kernels if start is not None and e > start)
    if not after:
        return None
    busy, cur_start, cur_end = 0.0, after[0][0], after[0][1]
    for s, e in after[1:]:
        if s > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    busy += cur_end - cur_start
    window = cur_end - start
    return busy / window if window > 0 else None


def main(argv: list[str] | None = None) -> int:
    """The offline rows of `shinkai bench step` alone (async off and on, phases, and on a GPU the busy share)."""
    parser = argparse.ArgumentParser(prog="python -m services.bench.step.offline")
    parser.add_argument("--model", default=None, help="preset: v41-s1 on a GPU (default there), tiny on CPU")
    parser.add_argument("--layers", type=int, default=None, help="keep this many layers (bench step's subsets)")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20, help="tokens generated per request")
    parser.add_argument("--no-graphs", action="store_true", help="decode eagerly on a GPU")
    parser.add_argument("--json", dest="json_path", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    import torch

    from services.bench.step.build import builder

    cuda = torch.cuda.is_available()
    model = args.model or ("v41-s1" if cuda else "tiny")
    backend = "kernels" if cuda else "torch"
    if not cuda:
        torch.set_num_threads(1)
    graphs = cuda and not args.no_graphs
    build, cfg, _ = builder(model, torch.device("cuda" if cuda else "cpu"), backend, args.layers, graphs)
    print(f"model {model} ({cfg.num_hidden_layers} layers), backend {backend}, CUDA graphs {graphs}")
    rows = offline_section(build, cfg, args.batch, args.steps)
    if args.json_path:
        import json
        from pathlib import Path

        Path(args.json_path).write_text(
            json.dumps({"model": model, "layers": cfg.num_hidden_layers, "graphs": graphs, "rows": rows}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
