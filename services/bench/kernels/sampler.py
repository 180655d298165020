"""Fused sampler benchmark (`python -m services.bench.kernels.run --only sampler`), V = 129,280.

Rows: greedy, and temperature 0.7 with top-p 0.9 (the radix selects run), at R ∈ (1, 16, 64, 256).
Fewest bytes: the logits read once (fp32) and the outputs (id int64, logprob fp32, error flag); no
FLOP term (a few ops per logit on the CUDA cores). The torch side is ``services.worker.sampling.sampler.Sampler``
on the same CUDA tensors, timed eagerly: it builds its parameter tensors from Python rows each call, so
it cannot be captured (its time includes that host work, as the engine's does today).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from services.bench.harness import DEVICE, _bench, _bench_replay, _row

if TYPE_CHECKING:
    import torch

VOCAB = 129280
ROWS = (1, 16, 64, 256)
QUICK_ROWS = (1, 64, 256)
CASES = {"greedy": dict(temperature=0.0, top_p=1.0), "top-p 0.9 T 0.7": dict(temperature=0.7, top_p=0.9)}
# (block, num_warps) tried besides the launcher's default (1024, 8) on top-p rows at SWEEP_ROWS:
# 16 warps give a lone row's program twice the threads (128 registers fit 512 threads, no spills).
SWEEP = ((1024, 16), (512, 4))
SWEEP_ROWS = (1, 256)


def sampler_problem(
    num_rows: int, case: str, gen: torch.Generator, device: str | None = None, vocab: int = VOCAB
) -> tuple[torch.Tensor, list]:
    """fp32 logits [R, V] like a language model's (a few confident tokens over a noisy floor) and rows."""
    import torch

    from services.worker.sampling.sampler import SamplingRow

    device = device or DEVICE
    logits = torch.randn(num_rows, vocab, device=device, generator=gen) * 2
    hot = torch.randint(0, vocab, (num_rows, 8), device=device, generator=gen)
    logits.scatter_(1, hot, torch.rand(num_rows, 8, device=device, generator=gen) * 12 + 4)
    params = CASES[case]
    rows = [
        SamplingRow(params["temperature"], 0, params["top_p"], 1000 + i, 50 + i, None, (), 0) for i in range(num_rows)
    ]
    return logits, rows


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, object]]:
    import sys

    from kernels.sampler import sample, sampling_tensors
    from services.worker.sampling.sampler import Sampler

    out = []
    for case in CASES:
        for num_rows in QUICK_ROWS if quick else ROWS:
            logits, rows = sampler_problem(num_rows, case, gen)
            params = sampling_tensors(rows, DEVICE)
            ours = _bench_replay(lambda: sample(logits, params))
            sampler = Sampler()
            theirs = _bench(lambda: sampler(logits, rows))
            nbytes = logits.numel() * logits.element_size() + num_rows * (8 + 4 + 1)
            shape = f"R={num_rows} V={VOCAB} fp32"
            out.append(
                _row(
                    f"sampler {case}",
                    shape,
                    ours,
                    nbytes,
                    0.0,
                    ceil,
                    theirs,
                    "torch: services.worker.sampling.sampler.Sampler on CUDA (eager; host-built parameters)",
                )
            )
            if case == "greedy" or num_rows not in SWEEP_ROWS:
                continue
            for block, warps in SWEEP:
                try:
                    t = _bench_replay(lambda b=block, w=warps: sample(logits, params, block=b, num_warps=w))
                except Exception as err:  # noqa: BLE001 - a config that fails is reported, not fatal
                    print(
                        f"  sampler block={block} warps={warps} failed: {type(err).__name__}: {str(err)[:120]}",
                        file=sys.stderr,
                    )
                    continue
                out.append(_row(f"sampler {case} [block={block} warps={warps}]", shape, t, nbytes, 0.0, ceil, theirs))
    return out
