"""A small batch-invariance check run in a fresh process, so a test can set OMP_NUM_THREADS and
ATEN_CPU_CAPABILITY (read once, at torch's import) for it: ``python -m tests.services.engine.batch_invariant_probe``.

It prints one JSON line: whether four prompts sampled as one batch equal each prompt alone (forced to the
batch's tokens) under ``==``, and whether a chunked prefill's logits equal a whole one's."""

from __future__ import annotations

import json
import os

import torch

from services.engine import LLM, SamplingParams


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 129_000, (n,), generator=g).tolist()


def main() -> None:
    # torch caps its pool at the cores it sees; OMP_NUM_THREADS above that is honoured here on purpose.
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    llm = LLM(model="tiny", block_size=16, max_num_batched_tokens=32, max_num_seqs=4, batch_invariant=True)
    prompts = [_prompt(k, 9 + 13 * k) for k in range(4)]
    params = [
        SamplingParams(max_tokens=6, temperature=1.0, top_p=0.7, logprobs=5, seed=k, ignore_eos=True) for k in range(4)
    ]
    batch = llm.generate(prompts, params)
    alone_equal = []
    for prompt, together in zip(prompts, batch):
        forced = SamplingParams(
            max_tokens=6,
            temperature=1.0,
            top_p=0.7,
            logprobs=5,
            ignore_eos=True,
            forced_token_ids=tuple(together.token_ids),
        )
        alone = llm.generate(prompt, forced)[0]
        alone_equal.append(
            (alone.token_ids, alone.logprobs, alone.top_logprobs)
            == (together.token_ids, together.logprobs, together.top_logprobs)
        )
    ids = torch.tensor([prompts[3]])
    from model.batch_invariant import batch_invariant

    with torch.no_grad(), batch_invariant():
        full = llm.source.model(ids)
        prefix = llm.source.model(ids[:, :17])
    print(
        json.dumps(
            {
                "threads": torch.get_num_threads(),
                "capability": torch.backends.cpu.get_cpu_capability(),
                "alone_equal": alone_equal,
                "prefix_equal": bool(torch.equal(prefix, full[:, :17])),
            }
        )
    )


if __name__ == "__main__":
    main()
