"""`shinkai bench step --batch-invariant`: decode steps and a prefill step with the mode on, beside the same
sizes with it off, from one run; the cost is the ratio of the two step times."""

from __future__ import annotations

import time
from typing import Any


def batch_invariant_section(build, cfg, sizes) -> list[dict[str, Any]]:
    import torch

    from services.bench.step_build import runner_cache
    from services.bench.step_timing import _sync, time_decode
    from services.engine import SamplingParams

    context = sizes["contexts"][0]
    rows = []
    for batch in sizes["batches"]:
        ms = {}
        for flag in (False, True):
            llm = build(max_num_seqs=batch, max_model_len=context + sizes["steps"] + 16, batch_invariant=flag)
            t = time_decode(llm.engine, runner_cache(llm), batch=batch, context=context, steps=sizes["steps"],
                            vocab_size=cfg.vocab_size)
            ms[flag] = t.median * 1e3
            del llm
        rows.append({"section": "batch-invariant", "kind": "decode", "batch": batch, "context": context,
                     "ms_off": ms[False], "ms_on": ms[True], "cost": ms[True] / ms[False] - 1})
        print(f"batch-invariant decode batch {batch:>4}: {ms[False]:9.2f} ms off, {ms[True]:9.2f} ms on "
              f"({100 * rows[-1]['cost']:+.0f}%)")
    tokens = sizes["prefill"][0]
    ms = {}
    for flag in (False, True):
        llm = build(max_num_seqs=1, max_model_len=tokens + 8, max_num_batched_tokens=tokens, batch_invariant=flag)
        device = runner_cache(llm).blocks.device
        seconds = []
        for i in range(2):  # the first is a warm-up
            llm.engine.add_request(f"p{i}", torch.randint(3, cfg.vocab_size, (tokens,)).tolist(),
                                   SamplingParams(max_tokens=1, ignore_eos=True))
            _sync(device)
            t0 = time.perf_counter()
            llm.engine.step()
            _sync(device)
            seconds.append(time.perf_counter() - t0)
            while llm.engine.has_unfinished():
                llm.engine.step()
        ms[flag] = seconds[-1] * 1e3
        del llm
    rows.append({"section": "batch-invariant", "kind": "prefill", "tokens": tokens, "ms_off": ms[False],
                 "ms_on": ms[True], "cost": ms[True] / ms[False] - 1})
    print(f"batch-invariant prefill {tokens:>6} tokens: {ms[False]:9.2f} ms off, {ms[True]:9.2f} ms on "
          f"({100 * rows[-1]['cost']:+.0f}%)")
    return rows
