"""mHC kernels (``kernels/mhc.py``) at the Flash shapes (n 4, D 5120, bf16 streams) against the module's
own torch functions (``model/deepseek_v41/mhc.py``): HyperConnection.forward, collapse, expand.

Fewest bytes: the streams read (and written), y / x in bf16, the site's fp32 fn [24, 4·D] once (the
kernel reads its two-part split, twice that, from L2 after the first token tile), the fp32 mix
outputs. FLOPs: the projection, 2 · T · 24 · 4D, against a tf32 peak taken as half the measured bf16 one.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

HC, HIDDEN = 4, 5120
TOKENS = (1, 64, 256, 4096, 16384)
QUICK_TOKENS = (1, 256, 16384)
SWEEP = [(16, None, 4), (32, None, 8), (32, None, 4), (64, None, 8), (64, 1, 8)]  # (block_t, split, num_warps)


def problem(num_tokens: int, gen: torch.Generator, device: str = "cuda", hidden: int = HIDDEN) -> dict[str, Any]:
    """Streams, a sublayer output, a carried pre and two sites (random weights, logits of order 1)."""
    import dataclasses

    import torch

    from kernels.mhc import MixWeights
    from model.deepseek_v41.mhc import HyperConnection
    from model.deepseek_v41.presets import V41_S1

    cfg = dataclasses.replace(V41_S1, hidden_size=hidden)
    sites = []
    for _ in range(2):
        hc = HyperConnection(cfg).to(device).requires_grad_(False)
        rows, k = hc.fn.shape
        hc.fn.copy_(torch.randn(rows, k, device=device, generator=gen) * 2 * k**-0.5)
        hc.base.copy_(torch.randn(rows, device=device, generator=gen))
        hc.scale.copy_(torch.rand(3, device=device, generator=gen) + 0.5)
        sites.append(hc)
    h = (torch.randn(num_tokens, HC, hidden, device=device, generator=gen) * 3).to(torch.bfloat16)
    y = (torch.randn(num_tokens, hidden, device=device, generator=gen) * 2).to(torch.bfloat16)
    pre = torch.rand(num_tokens, HC, device=device, generator=gen)
    mix = sites[0](h.unsqueeze(0))
    return dict(
        h=h, y=y, pre=pre, sites=sites, weights=[MixWeights.of(s) for s in sites], mix=type(mix)(*(t[0] for t in mix))
    )


def torch_ops(p: dict[str, Any]) -> dict[str, Any]:
    """The module's functions on [1, T, …] (they take [B, S, n, D]), one closure per benchmarked op."""
    from model.deepseek_v41 import mhc

    h, y, pre = p["h"][None], p["y"][None], p["pre"][None]
    mix = type(p["mix"])(*(t[None] for t in p["mix"]))
    site_a, site_f = p["sites"]

    def expand_mix() -> object:
        h_new = mhc.expand(y, h, mix)
        return site_f(h_new), mhc.collapse(h_new, mix.pre)

    return {
        "mix": lambda: (site_a(h), mhc.collapse(h, pre)),
        "expand_mix": expand_mix,
        "collapse": lambda: mhc.collapse(h, pre),
        "expand": lambda: mhc.expand(y, h, mix),
    }


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, object]]:
    import torch

    from kernels import mhc
    from services.bench.harness import _bench_replay, _row

    ceil = {**ceil, "tf32_peak": ceil["bf16_peak"] / 2}
    rows = []
    for num_tokens in QUICK_TOKENS if quick else TOKENS:
        with torch.no_grad():
            p = problem(num_tokens, gen)
            h, y, pre, mix = p["h"], p["y"], p["pre"], p["mix"]
            w_a, w_f = p["weights"]
            theirs = torch_ops(p)
            stream_bytes = num_tokens * HC * HIDDEN * 2
            row_bytes = num_tokens * HIDDEN * 2
            weight_bytes = HC * (HC + 2) * HC * HIDDEN * 4 + 2 * HC * (HC + 2) * 4
            mix_out = num_tokens * HC * (HC + 2) * 4
            flops = 2.0 * num_tokens * HC * (HC + 2) * HC * HIDDEN
            shape = f"T={num_tokens} n={HC} D={HIDDEN} bf16"
            ops = {
                "mix": (
                    lambda: mhc.mhc_mix(h, w_a, pre),
                    stream_bytes + row_bytes + weight_bytes + mix_out,
                    flops,
                    "mhc mix + collapse",
                ),
                "expand_mix": (
                    lambda: mhc.mhc_expand_mix(y, h, mix, w_f, mix.pre),
                    2 * stream_bytes + 2 * row_bytes + weight_bytes + 2 * mix_out,
                    flops,
                    "mhc expand + mix + collapse",
                ),
                "collapse": (lambda: mhc.collapse(h, pre), stream_bytes + row_bytes, 0.0, "mhc collapse"),
                "expand": (lambda: mhc.expand(y, h, mix), 2 * stream_bytes + row_bytes + mix_out, 0.0, "mhc expand"),
            }
            for key, (fn, nbytes, op_flops, name) in ops.items():
                ours = _bench_replay(fn)
                ref = _bench_replay(theirs[key])
                rows.append(
                    _row(
                        name,
                        shape,
                        ours,
                        nbytes,
                        op_flops,
                        ceil,
                        ref,
                        "torch: model/deepseek_v41/mhc.py functions",
                        peak="tf32_peak",
                    )
                )
            if not quick:
                rows += _sweep(
                    num_tokens,
                    p,
                    nbytes=2 * stream_bytes + 2 * row_bytes + weight_bytes + 2 * mix_out,
                    flops=flops,
                    ceil=ceil,
                    shape=shape,
                )
    return rows


def _sweep(
    num_tokens: int, p: dict[str, Any], nbytes: float, flops: float, ceil: dict[str, float], shape: str
) -> list[dict[str, object]]:
    """expand + mix + collapse under a few (block_t, split, num_warps); the best as its own row."""
    from kernels import mhc
    from services.bench.harness import _row, sweep_configs

    configs = [dict(block_t=block_t, split=split, num_warps=warps) for block_t, split, warps in SWEEP]
    tried, best = sweep_configs(
        "mhc", configs, lambda c: mhc.mhc_expand_mix(p["y"], p["h"], p["mix"], p["weights"][1], p["mix"].pre, **c)
    )
    print(f"  mhc T={num_tokens}: sweep {tried}", file=sys.stderr)
    if best is None:
        return []
    return [
        _row(
            "mhc expand + mix + collapse [best of sweep]",
            shape,
            best[0],
            nbytes,
            flops,
            ceil,
            None,
            str(best[1]),
            peak="tf32_peak",
        )
    ]
