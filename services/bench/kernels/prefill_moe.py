"""A prefill MoE layer's experts (`shinkai bench kernels --only prefill_moe`): v41-s1's 48 routed experts
(top-6, uniform random routing) plus the shared expert, at 1K–16K tokens, both ways ``KernelMoE`` can run
them on the same layout, operands and scales:

- the grouped Triton GEMM pair (``kernels.moe_grouped_gemm.moe_experts``, the shared expert in its own
  launches, split over M);
- expert by expert through cuBLASLt's block-scaled GEMM (services/worker/kernel_model/block_scaled_experts.py), with its
  one host read of the counts, its gathers, the torch SwiGLU and h's quantisation.

The layer rows time x's quantisation, both products, the epilogue and the combine (the router and the layout
are shared and left out); then each product alone, both ways (``bench_products``), which says whether a mixed
path (cuBLASLt for one product, Triton for the other) would pay. Timed eagerly with the L2 flushed, as prefill runs.
A row of the cuBLASLt path is measured at every size, even where ``block_scaled_experts.applies`` keeps the engine on
Triton (below ``MIN_ROWS_PER_EXPERT`` routed rows per expert): these rows are what that threshold should follow.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.bench.harness import DEVICE, _bench, _row
from services.bench.kernels.decode_gemms import layer_meta
from services.bench.kernels.run import EXPERTS, HIDDEN, INTER, SWIGLU_LIMIT, TOP_K, _random_weights

if TYPE_CHECKING:
    import torch

TOKENS = (1024, 4096, 16384)
QUICK_TOKENS = (1024, 4096)


def bench_layer(num_tokens: int, ceil: dict[str, float], gen: torch.Generator) -> list[dict[str, Any]]:
    import torch

    from kernels.moe_combine import moe_combine
    from kernels.moe_grouped_gemm import moe_experts
    from kernels.quant_fp8 import quantize_act
    from services.worker.kernel_model import block_scaled_experts, block_scaled_gemm

    num_stacked = EXPERTS + 1
    meta = layer_meta(num_tokens, gen)
    w13, s13 = _random_weights(2 * INTER, HIDDEN, gen, num_stacked)
    w2, s2 = _random_weights(HIDDEN, INTER, gen, num_stacked)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    picks = num_tokens * (TOP_K + 1)
    active = int(meta["num_active"])
    weight_bytes = active * (2 * INTER * HIDDEN + HIDDEN * INTER) * (1 + 4 / 128**2)
    nbytes = weight_bytes + num_tokens * HIDDEN * (2 + 4) + picks * (INTER + HIDDEN * 2)
    flops = 2.0 * picks * (2 * INTER * HIDDEN + HIDDEN * INTER)
    shape = f"T={num_tokens} E={EXPERTS}+1 shared k={TOP_K} D={HIDDEN} I={INTER}"

    def triton_call() -> object:
        return moe_experts(x, meta, w13, s13, w2, s2, SWIGLU_LIMIT, shared_last=True)

    triton_s = _bench(triton_call)
    taken = block_scaled_experts.applies(num_tokens, TOP_K, EXPERTS, torch.device(DEVICE), False)
    rows = [
        _row(
            "prefill moe layer [grouped Triton]" + ("" if taken else " (engine)"),
            shape,
            triton_s,
            nbytes,
            flops,
            ceil,
            None,
            "gate/up + down + combine, shared expert apart",
        )
    ]
    if block_scaled_gemm.available(torch.device(DEVICE), torch.float32) and block_scaled_gemm.available(
        torch.device(DEVICE), torch.bfloat16
    ):
        scale_b13, scale_b2 = block_scaled_gemm.scale_b(s13), block_scaled_gemm.scale_b(s2)

        def cublas_call() -> object:
            return block_scaled_experts.experts(
                x, meta, w13, scale_b13, w2, scale_b2, SWIGLU_LIMIT, quantize_act, moe_combine
            )

        seconds = _bench(cublas_call)
        rows.append(
            _row(
                "prefill moe layer [cuBLASLt per expert]" + (" (engine)" if taken else ""),
                shape,
                seconds,
                nbytes,
                flops,
                ceil,
                None,
                f"{triton_s / seconds:.2f}x the grouped Triton pair",
            )
        )
        rows += bench_products(num_tokens, meta, (w13, s13, scale_b13), (w2, s2, scale_b2), x, ceil)
    return rows


def bench_products(
    num_tokens: int, meta: dict[str, torch.Tensor], gate_up: tuple, down: tuple, x: torch.Tensor, ceil: dict[str, float]
) -> list[dict[str, Any]]:
    """Each of the layer's two products alone, both ways, on the same operands (gathered rows for cuBLASLt, as
    ``block_scaled_experts`` lays them out; one h drawn at random for both down products): which product
    gains, which loses. The Triton gate/up includes its SwiGLU epilogue and h's quantisation."""
    import torch

    from kernels.moe_grouped_gemm import default_block_m, empty_output, moe_grouped_gemm, split_shared
    from kernels.quant_fp8 import quantize_act
    from services.worker.kernel_model import block_scaled_experts, block_scaled_gemm

    (w13, s13, scale_b13), (w2, s2, scale_b2) = gate_up, down
    num_stacked, picks = EXPERTS + 1, num_tokens * (TOP_K + 1)
    flat, _, spans = block_scaled_experts.compact_rows(meta["counts"].cpu(), num_tokens)
    flat = flat.to(x.device)
    tokens = meta["row_ids"].reshape(-1)[flat].long()
    x_q, x_s = quantize_act(x)
    a = (x_q.view(torch.uint8)[tokens].view(x_q.dtype), x_s[tokens])  # e4m3 gathered as bytes
    # One random h for both down products: the masked layout's, and its slots gathered into compact rows.
    h_masked = quantize_act(torch.randn(num_stacked * num_tokens, INTER, device=x.device, dtype=torch.bfloat16))
    h = (h_masked[0].view(torch.uint8)[flat].view(h_masked[0].dtype), h_masked[1][flat])
    h_masked = (h_masked[0].view(num_stacked, num_tokens, INTER), h_masked[1].view(num_stacked, num_tokens, -1))
    block_m = default_block_m(picks / num_stacked)
    routed, shared = split_shared(meta)

    def triton_gate_up() -> object:
        out = empty_output(num_stacked, num_tokens, INTER, torch.float8_e4m3fn, x.device)
        for part, ex in ((routed, slice(0, -1)), (shared, slice(-1, None))):
            moe_grouped_gemm(
                (x_q, x_s),
                w13[ex],
                s13[ex],
                part,
                gather=True,
                swiglu_limit=SWIGLU_LIMIT,
                out_dtype=torch.float8_e4m3fn,
                block_m=block_m,
                out=(out[0][ex], out[1][ex]),
            )
        return out

    def triton_down() -> object:
        out = empty_output(num_stacked, num_tokens, HIDDEN, torch.bfloat16, x.device)
        for part, ex in ((routed, slice(0, -1)), (shared, slice(-1, None))):
            moe_grouped_gemm(
                (h_masked[0][ex], h_masked[1][ex]), w2[ex], s2[ex], part, gather=False, block_m=block_m, out=out[ex]
            )
        return out

    def cublas_gate_up() -> object:
        return [block_scaled_gemm.matmul((a[0][r], a[1][r]), w13[e], scale_b13[e], torch.float32) for e, r in spans]

    def cublas_down() -> object:
        return [block_scaled_gemm.matmul((h[0][r], h[1][r]), w2[e], scale_b2[e], torch.bfloat16) for e, r in spans]

    rows = []
    shape = f"T={num_tokens} E={EXPERTS}+1 shared k={TOP_K}"
    for name, n, k, triton_fn, cublas_fn in (
        ("gate/up", 2 * INTER, HIDDEN, triton_gate_up, cublas_gate_up),
        ("down", HIDDEN, INTER, triton_down, cublas_down),
    ):
        flops = 2.0 * picks * n * k
        nbytes = int(meta["num_active"]) * n * k + picks * (k + n)
        triton_s, cublas_s = _bench(triton_fn), _bench(cublas_fn)
        rows.append(
            _row(
                f"prefill moe {name} [grouped Triton]",
                f"{shape} N={n} K={k}",
                triton_s,
                nbytes,
                flops,
                ceil,
                None,
                "masked layout, shared expert apart" + (", SwiGLU epilogue" if n > HIDDEN else ""),
            )
        )
        rows.append(
            _row(
                f"prefill moe {name} [cuBLASLt per expert]",
                f"{shape} N={n} K={k}",
                cublas_s,
                nbytes,
                flops,
                ceil,
                None,
                f"{triton_s / cublas_s:.2f}x the grouped Triton GEMM",
            )
        )
    return rows


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for t in QUICK_TOKENS if quick else TOKENS:
        rows += bench_layer(t, ceil, gen)
    return rows
