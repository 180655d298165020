"""Host ms of the samplers' per-step parameter building, by batch size and row mix.

Times ``kernels.sampler.sampling_tensors`` (the fused sampler's per-row tensors, built on the host; the
upload is not timed: on CPU it is a no-op, on CUDA it is enqueued) and the torch ``Sampler``'s whole call
(the speculative path's sampler) on a 16-token vocabulary, where its math is small and its per-row host
work (``draw_bits``'s table, temperatures, greedy flags, rank and top-p limits, bans) is most of the time.
Mixes: ``greedy`` (every row T = 0), ``mix`` (seeded rows, alternately top-p 0.9 and top-k 50, T = 0.7),
``mix+bans`` (``mix`` with 8 banned ids a row, as the end-token ban and a short blacklist), and
``mix+bias`` (``mix`` with 4 logit_bias pairs a row). Median of ``--repeats`` calls, single-threaded.

    python3 scripts/diagnostics/sampler_host.py [--rows 1 64 256] [--repeats 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def rows_of(mix: str, n: int) -> list:
    from services.worker.sampling.sampler import SamplingRow

    def one(i: int) -> SamplingRow:
        if mix == "greedy":
            return SamplingRow(0.0, 0, 1.0, 1000 + i, 50 + i, None, (), 0)
        bans = tuple(range(100 + i, 108 + i)) if mix == "mix+bans" else ()
        bias = tuple((200 + 3 * j, 0.5 * j) for j in range(4)) if mix == "mix+bias" else ()
        top_p, top_k = (0.9, 0) if i % 2 else (1.0, 50)
        return SamplingRow(0.7, top_k, top_p, 1000 + i, 50 + i, None, bans, 0, logit_bias=bias)

    return [one(i) for i in range(n)]


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    import torch

    from kernels.sampler import sampling_tensors
    from services.worker.sampling.sampler import Sampler

    torch.set_num_threads(1)
    print(f"{'mix':<10} {'rows':>5} {'sampling_tensors ms':>20} {'Sampler V=16 ms':>16}")
    for mix in ("greedy", "mix", "mix+bans", "mix+bias"):
        for n in args.rows:
            rows = rows_of(mix, n)
            fused = median_ms(lambda: sampling_tensors(rows, "cpu"), args.repeats)
            logits = torch.randn(n, 16, generator=torch.Generator().manual_seed(n))
            rows = [r if not r.banned_token_ids else replace(r, banned_token_ids=(3, 5)) for r in rows]
            rows = [r if not r.logit_bias else replace(r, logit_bias=((1, 0.5), (7, -1.0))) for r in rows]
            torch_ms = median_ms(lambda: Sampler()(logits, rows), args.repeats)
            print(f"{mix:<10} {n:>5} {fused:>20.3f} {torch_ms:>16.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
