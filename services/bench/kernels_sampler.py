"""Fused sampler benchmark (`python -m services.bench.kernels --only sampler`), V = 129,280.

Rows: greedy, and temperature 0.7 with top-p 0.9 (the radix selects run), at R ∈ (1, 16, 64, 256).
Fewest bytes: the logits read once (fp32) and the outputs (id int64, logprob fp32, error flag); no
FLOP term (a few ops per logit on the CUDA cores). The torch side is ``services.worker.sampler.Sampler``
on the same CUDA tensors, timed eagerly: it builds its parameter tensors from Python rows each call, so
it cannot be captured (its time includes that host work, as the engine's does today).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.bench.kernels import DEVICE, _bench, _bench_replay, _row

if TYPE_CHECKING:
    import torch

VOCAB = 129280
ROWS = (1, 16, 64, 256)
QUICK_ROWS = (1, 64, 256)
CASES = {"greedy": dict(temperature=0.0, top_p=1.0), "top-p 0.9 T 0.7": dict(temperature=0.7, top_p=0.9)}


def sampler_problem(num_rows: int, case: str, gen: torch.Generator, device: str | None = None,
                    vocab: int = VOCAB) -> tuple[torch.Tensor, list]:
    """fp32 logits [R, V] like a language model's (a few confident tokens over a noisy floor) and rows."""
    import torch

    from services.worker.sampler import SamplingRow

    device = device or DEVICE
    logits = torch.randn(num_rows, vocab, device=device, generator=gen) * 2
    hot = torch.randint(0, vocab, (num_rows, 8), device=device, generator=gen)
    logits.scatter_(1, hot, torch.rand(num_rows, 8, device=device, generator=gen) * 12 + 4)
    params = CASES[case]
    rows = [SamplingRow(params["temperature"], 0, params["top_p"], 1000 + i, 50 + i, None, (), 0)
            for i in range(num_rows)]
    return logits, rows


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, object]]:
    from kernels.sampler import sample, sampling_params
    from services.worker.sampler import Sampler

    out = []
    for case in CASES:
        for num_rows in QUICK_ROWS if quick else ROWS:
            logits, rows = sampler_problem(num_rows, case, gen)
            params = sampling_params(rows, DEVICE)
            ours = _bench_replay(lambda: sample(logits, params))
            sampler = Sampler()
            theirs = _bench(lambda: sampler(logits, rows))
            nbytes = logits.numel() * logits.element_size() + num_rows * (8 + 4 + 1)
            out.append(_row(f"sampler {case}", f"R={num_rows} V={VOCAB} fp32", ours, nbytes, 0.0, ceil, theirs,
                            "torch: services.worker.sampler.Sampler on CUDA (eager; host-built parameters)"))
    return out
