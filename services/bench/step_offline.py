"""`shinkai bench step`'s offline section: the same prompts generated with async scheduling off and
on, tokens/s from an unprofiled run, and the GPU-busy fraction (kernel time from a profiled rerun over
the unprofiled wall time)."""

from __future__ import annotations

import time
from typing import Any


def offline_section(build, cfg, batch: int, steps: int) -> list[dict[str, Any]]:
    import torch

    from services.engine import SamplingParams

    rows = []
    for flag in (False, True):
        llm = build(max_num_seqs=batch, max_model_len=256, async_scheduling=flag)
        prompts = [torch.randint(3, cfg.vocab_size, (32,), generator=torch.Generator().manual_seed(i)).tolist()
                   for i in range(batch)]
        params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
        # Warm-up on the same prompts: the prefill chunks' shapes compile here, not in the timed run
        # (a one-prompt warm-up left them to the first timed run: 12.7 s against 5.5 s profiled, H200).
        llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))
        busy = kernel_s = profiled_wall = None
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)  # tokens/s without the profiler's overhead
        wall = time.perf_counter() - t0
        if torch.cuda.is_available():
            # Kernel time from a second, profiled run of the same work (the same kernels), over the
            # unprofiled run's wall time: the profiler slows the host, not the device.
            from torch.profiler import ProfilerActivity, profile

            t1 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                llm.generate(prompts, params)
            profiled_wall = time.perf_counter() - t1
            kernel_s = 1e-6 * sum(e.device_time for e in prof.events() if e.device_type.name == "CUDA")
            busy = min(1.0, kernel_s / wall)
        tokens = sum(len(o.token_ids) for o in outs)
        rows.append({"section": "offline", "async": flag, "batch": batch, "tokens": tokens, "seconds": wall,
                     "tokens_per_s": tokens / wall, "gpu_busy": busy, "kernel_s": kernel_s,
                     "profiled_seconds": profiled_wall})
        print(f"offline async={'on ' if flag else 'off'} batch {batch}: {tokens / wall:9.1f} tokens/s"
              + (f"  GPU busy {100 * busy:.1f}% (kernels {kernel_s:.2f} s, wall {wall:.2f} s, profiled wall "
                 f"{profiled_wall:.2f} s)" if busy is not None else ""))
        del llm
    return rows
