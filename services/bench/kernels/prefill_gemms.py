"""Prefill's dense FP8 GEMMs (`shinkai bench kernels --only prefill_gemms`): v41-s1's projections at 1K–16K
tokens through the Triton one-expert GEMM the engine used before (BLOCK_M 32, ``fp8_linear.linear_block_m``)
and through cuBLASLt's block-scaled GEMM (services/worker/kernel_model/block_scaled_gemm.py), the same operands and
scales, the activation quantisation left out of both (it is shared); and attention's grouped wo_a as the
whole module both ways, also at decode's 64 and 256 rows. Timed eagerly with the L2 flushed: prefill is not
graph-captured, and these kernels run for 0.1–10 ms, far above their launch cost.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.bench.harness import DEVICE, _bench, _row
from services.bench.kernels.decode_gemms import projection_shapes
from services.bench.kernels.run import _random_weights

if TYPE_CHECKING:
    import torch

TOKENS = (1024, 4096, 16384)
QUICK_TOKENS = (1024, 4096)


def bench_projections(num_tokens: int, ceil: dict[str, float], gen: torch.Generator) -> list[dict[str, Any]]:
    import torch

    from kernels.moe_grouped_gemm import moe_grouped_gemm
    from kernels.quant_fp8 import quantize_act
    from services.worker.kernel_model import block_scaled_gemm
    from services.worker.kernel_model.fp8_linear import linear_block_m, one_expert_meta

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
        rows.append(
            _row(f"prefill {label} [Triton]", shape, triton_s, nbytes, flops, ceil, None, "one-expert FP8 GEMM")
        )
        if cublas:
            scale_b = block_scaled_gemm.scale_b(s[0])
            seconds = _bench(lambda: block_scaled_gemm.matmul(a, w[0], scale_b))
            rows.append(
                _row(
                    f"prefill {label} [cuBLASLt block-scaled]",
                    shape,
                    seconds,
                    nbytes,
                    flops,
                    ceil,
                    None,
                    f"{triton_s / seconds:.2f}x the Triton GEMM",
                )
            )
    return rows


WO_A_TOKENS = (64, 256)
"""Decode's graph-captured sizes, below ``GROUPED_MIN_TOKENS``: both paths measured there too (the crossover)."""


def bench_wo_a(num_tokens: int, ceil: dict[str, float], gen: torch.Generator) -> list[dict[str, Any]]:
    """Attention's grouped wo_a (v41-s1: 8 groups of 4,096 → 1,024) as the engine runs it, the whole module
    (``GroupedKernelLinear``: the activations' quantisation, and for cuBLASLt the group-major copies and one GEMM a
    group): the Triton grouped GEMM against cuBLASLt, each forced for its call (``GROUPED_MIN_TOKENS`` moved)."""
    import torch

    from services.bench.step.build import model_config
    from services.worker.kernel_model import block_scaled_gemm
    from services.worker.kernel_model.fp8_linear import GroupedKernelLinear
    from services.worker.kernel_model.kernel_set import KernelSet

    cfg = model_config("v41-s1", None)
    groups, rank = cfg.o_groups, cfg.o_lora_rank
    width = cfg.num_attention_heads * cfg.head_dim // groups
    layer = GroupedKernelLinear(
        torch.randn(groups * rank, width, device=DEVICE, generator=gen) * 0.02, groups, "fp8", KernelSet.compiled()
    )
    x = torch.randn(num_tokens, groups, width, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    nbytes = groups * rank * width + num_tokens * groups * (width * 2 + rank * 2)
    flops = 2.0 * num_tokens * groups * rank * width
    shape = f"T={num_tokens} G={groups} R={rank} Kg={width}"
    threshold = block_scaled_gemm.GROUPED_MIN_TOKENS
    try:
        block_scaled_gemm.GROUPED_MIN_TOKENS = 1 << 30
        triton_s = _bench(lambda: layer(x))
        block_scaled_gemm.GROUPED_MIN_TOKENS = 1
        seconds = _bench(lambda: layer(x)) if block_scaled_gemm.available(torch.device(DEVICE)) else None
    finally:
        block_scaled_gemm.GROUPED_MIN_TOKENS = threshold
    rows = [_row("wo_a grouped [Triton]", shape, triton_s, nbytes, flops, ceil, None, "grouped FP8 GEMM, G experts")]
    if seconds is not None:
        rows.append(
            _row(
                "wo_a grouped [cuBLASLt block-scaled]",
                shape,
                seconds,
                nbytes,
                flops,
                ceil,
                None,
                f"{triton_s / seconds:.2f}x the Triton GEMM; one GEMM a group",
            )
        )
    return rows


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for t in QUICK_TOKENS if quick else TOKENS:
        rows += bench_projections(t, ceil, gen)
    for t in WO_A_TOKENS + (QUICK_TOKENS if quick else TOKENS):
        rows += bench_wo_a(t, ceil, gen)
    return rows
