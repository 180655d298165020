"""`shinkai bench step --batch-invariant`: decode steps and a prefill step with the mode on, beside the same
sizes with it off, from one run; the cost is the ratio of the two step times."""

from __future__ import annotations

from typing import Any


def batch_invariant_section(build, cfg, sizes) -> list[dict[str, Any]]:
    from services.bench.step.build import runner_cache
    from services.bench.step.timing import decode_model_len, time_decode, time_prompt_step

    context = sizes["contexts"][0]
    rows = []
    for batch in sizes["batches"]:
        ms = {}
        for flag in (False, True):
            llm = build(
                max_num_seqs=batch, max_model_len=decode_model_len(batch, context, sizes["steps"]), batch_invariant=flag
            )
            t = time_decode(
                llm.engine,
                runner_cache(llm),
                batch=batch,
                context=context,
                steps=sizes["steps"],
                vocab_size=cfg.vocab_size,
            )
            ms[flag] = t.median * 1e3
            del llm
        rows.append(
            {
                "section": "batch-invariant",
                "kind": "decode",
                "batch": batch,
                "context": context,
                "ms_off": ms[False],
                "ms_on": ms[True],
                "cost": ms[True] / ms[False] - 1,
            }
        )
        print(
            f"batch-invariant decode batch {batch:>4}: {ms[False]:9.2f} ms off, {ms[True]:9.2f} ms on "
            f"({100 * rows[-1]['cost']:+.0f}%)"
        )
    tokens = sizes["prefill"][0]
    ms = {}
    for flag in (False, True):
        llm = build(max_num_seqs=1, max_model_len=tokens + 8, max_num_batched_tokens=tokens, batch_invariant=flag)
        ms[flag] = time_prompt_step(llm.engine, runner_cache(llm).blocks.device, tokens, cfg.vocab_size) * 1e3
        del llm
    rows.append(
        {
            "section": "batch-invariant",
            "kind": "prefill",
            "tokens": tokens,
            "ms_off": ms[False],
            "ms_on": ms[True],
            "cost": ms[True] / ms[False] - 1,
        }
    )
    print(
        f"batch-invariant prefill {tokens:>6} tokens: {ms[False]:9.2f} ms off, {ms[True]:9.2f} ms on "
        f"({100 * rows[-1]['cost']:+.0f}%)"
    )
    return rows
