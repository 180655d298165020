"""Prefill's dense FP8 GEMMs (`shinkai bench kernels --only prefill_gemms`): v41-s1's projections at 1K–16K
tokens through the Triton one-expert GEMM the engine used before (BLOCK_M 32, ``fp8_linear.linear_block_m``)
and through cuBLASLt's block-scaled GEMM (services/worker/block_scaled_gemm.py), the same operands and
scales. The activation quantisation is left out of both (it is shared). Timed eagerly with the L2 flushed:
prefill is not graph-captured, and these kernels run for 0.1–10 ms, far above their launch cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.bench.kernel_timing import DEVICE, _bench, _row
from services.bench.kernels import _random_weights
from services.bench.kernels_decode_gemms import projection_shapes

if TYPE_CHECKING:
    import torch

TOKENS = (1024, 4096, 16384)
QUICK_TOKENS = (1024, 4096)


def bench_projections(num_tokens: int, ceil: dict[str, float], gen: torch.Generator) -> list[dict[str, Any]]:
    import torch

    from kernels.moe_grouped_gemm import moe_grouped_gemm
    from kernels.quant_fp8 import quantize_act
    from services.worker import block_scaled_gemm
    from services.worker.fp8_linear import linear_block_m, one_expert_meta

    cublas = block_scaled_gemm.available(torch.device(DEVICE))
    meta = one_expert_meta(num_tokens, 1, torch.device(DEVICE))
    rows = []
    for label, (n, k) in projection_shapes().items():
        w, s = _random_weights(n, k, gen, 1)
        a = quantize_act(torch.randn(num_tokens, k, device=DEVICE, dtype=torch.bfloat16, generator=gen))
        nbytes = n * k + (n // 128) * (k // 128) * 4 + num_tokens * (k + 2 * n)
        flops = 2.0 * num_tokens * n * k
        shape = f"T={num_tokens} N={n} K={k}"

        def triton_call() -> object:
            return moe_grouped_gemm(a, w, s, meta, gather=True, block_m=linear_block_m(num_tokens), num_warps=4)

        triton_s = _bench(triton_call)
        rows.append(_row(f"prefill {label} [Triton]", shape, triton_s, nbytes, flops, ceil, None,
                         "one-expert FP8 GEMM"))
        if cublas:
            scale_b = block_scaled_gemm.scale_b(s[0])
            seconds = _bench(lambda: block_scaled_gemm.matmul(a, w[0], scale_b))
            rows.append(_row(f"prefill {label} [cuBLASLt block-scaled]", shape, seconds, nbytes, flops, ceil, None,
                             f"{triton_s / seconds:.2f}x the Triton GEMM"))
    return rows


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for t in QUICK_TOKENS if quick else TOKENS:
        rows += bench_projections(t, ceil, gen)
    return rows
