"""`shinkai bench kernels --only decode_gemms`: the FP8 GEMMs of a decode step as the engine launches
them, each beside the variant that would replace it (the choice waits on these rows):

- the MoE layer as ``KernelMoE`` runs it: 48 routed experts plus the shared expert stacked as expert
  48, which every token picks. The shared expert holds all T tokens while a routed one holds about
  6T/48, so with one work item per (expert, N tile) its items walk cdiv(T, BLOCK_M) M tiles each and
  finish last. The variant splits every expert's M tiles over work items (``m_split`` = the tile count;
  items past an expert's count exit at once): the same bits, and a balanced tail.
- the whole MoE layer with the shared expert stacked against its own launches (``moe_experts``' choice
  where its rows span more than one M tile).
- the attention and indexer projections (one-expert GEMMs) at BLOCK_M 16, the decode tile, against
  32, the prefill tile (``fp8_linear.linear_block_m``). ``scripts/diagnostics/tune_linear.py`` timed launches back to
  back and measured the host at these sizes; these rows are graph replays.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import triton

from services.bench.harness import DEVICE, _bench_replay, _row
from services.bench.kernels.run import EXPERTS, HIDDEN, INTER, SWIGLU_LIMIT, TOP_K, _random_weights

if TYPE_CHECKING:
    import torch

TOKENS = (16, 64, 128, 256)
QUICK_TOKENS = (64, 256)


def projection_shapes() -> dict[str, tuple[int, int]]:
    """Distinct (N, K) of v41-s1's FP8 projections over its layer kinds, padded to 128."""
    import torch

    from model.deepseek_v41.block import Block
    from services.bench.step.build import model_config
    from services.worker.kernel_model.backend import FP8_PROJECTIONS
    from services.worker.kernel_model.fp8_linear import round_up

    cfg = model_config("v41-s1", None)
    out: dict[str, tuple[int, int]] = {}
    for layer in (0, 2, 3):
        with torch.device("meta"):
            block = Block(cfg, layer)
        for mod in block.modules():
            for name in FP8_PROJECTIONS.get(type(mod).__name__, ()):
                w = getattr(mod, name).weight
                out.setdefault(f"{type(mod).__name__}.{name}", (round_up(w.shape[0]), round_up(w.shape[1])))
    return out


def layer_meta(num_tokens: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``KernelMoE._layout`` without a live mask: uniform top-6 of 48, plus the shared expert 48."""
    import torch

    from kernels.reference import route_metadata

    experts = torch.rand(num_tokens, EXPERTS, device=DEVICE, generator=gen).argsort(-1)[:, :TOP_K]
    shared = torch.full((num_tokens, 1), EXPERTS, dtype=experts.dtype, device=DEVICE)
    weights = torch.rand(num_tokens, TOP_K, device=DEVICE, generator=gen)
    return route_metadata(
        torch.cat((experts, shared), 1), torch.cat((weights, torch.ones_like(weights[:, :1])), 1), EXPERTS + 1
    )


def bench_moe_layer(num_tokens: int, ceil: dict[str, float], gen: torch.Generator) -> list[dict[str, Any]]:
    import torch

    from kernels.moe_grouped_gemm import default_block_m, moe_grouped_gemm
    from kernels.quant_fp8 import quantize_act

    meta = layer_meta(num_tokens, gen)
    num_stacked, picks = EXPERTS + 1, num_tokens * (TOP_K + 1)
    w13, s13 = _random_weights(2 * INTER, HIDDEN, gen, num_stacked)
    w2, s2 = _random_weights(HIDDEN, INTER, gen, num_stacked)
    x_q = quantize_act(torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen))
    block_m = default_block_m(meta["slot_of"].numel() / num_stacked)
    tiles = triton.cdiv(num_tokens, block_m)  # the shared expert's M tiles
    h_q = moe_grouped_gemm(x_q, w13, s13, meta, gather=True, swiglu_limit=SWIGLU_LIMIT, out_dtype=torch.float8_e4m3fn)
    active = int(meta["num_active"])
    rows = []
    cases = (
        (
            "moe layer gate/up+swiglu fp8→fp8",
            dict(a=x_q, w=w13, w_scale=s13, gather=True, swiglu_limit=SWIGLU_LIMIT, out_dtype=torch.float8_e4m3fn),
            2 * INTER,
            HIDDEN,
            num_tokens * HIDDEN + picks * INTER,
        ),
        (
            "moe layer down fp8→bf16",
            dict(a=h_q, w=w2, w_scale=s2, gather=False),
            HIDDEN,
            INTER,
            picks * INTER + picks * HIDDEN * 2,
        ),
    )
    for name, kwargs, n_w, k, act_bytes in cases:
        nbytes = active * (n_w * k + (n_w // 128) * (k // 128) * 4) + act_bytes
        flops = 2.0 * picks * n_w * k
        shape = f"T={num_tokens} E={EXPERTS}+1 shared k={TOP_K} N={n_w} K={k} BM={block_m}"
        for m_split in sorted({1, tiles}):

            def call(kw: dict[str, Any] = kwargs, s: int = m_split) -> object:
                return moe_grouped_gemm(**kw, meta=meta, m_split=s)

            label = f"{name} [m_split {m_split}]" + (" (engine)" if m_split == 1 else "")
            rows.append(
                _row(
                    label,
                    shape,
                    _bench_replay(call),
                    nbytes,
                    flops,
                    ceil,
                    None,
                    "the engine's launch" if m_split == 1 else "every expert's M tiles split over items",
                )
            )
    # The whole layer (x's quantisation, both GEMMs, the combine) with the shared expert stacked, and in its
    # own launches split over M, the engine's choice from more than one M tile (kernels/moe_grouped_gemm.py).
    from kernels.moe_grouped_gemm import moe_experts, shared_apart

    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    nbytes = active * (3 * INTER * HIDDEN) * (1 + 4 / 128**2) + num_tokens * HIDDEN * 6 + picks * (INTER + HIDDEN * 2)
    flops = 2.0 * picks * 3 * INTER * HIDDEN
    engine = shared_apart(num_tokens, block_m)
    for apart in (False, True):

        def layer(a: bool = apart) -> object:
            return moe_experts(x, meta, w13, s13, w2, s2, SWIGLU_LIMIT, shared_last=True, shared_launch=a)

        label = f"moe layer experts+combine [shared {'apart' if apart else 'stacked'}]" + (
            " (engine)" if apart == engine else ""
        )
        rows.append(
            _row(
                label,
                f"T={num_tokens} E={EXPERTS}+1 shared k={TOP_K} BM={block_m}",
                _bench_replay(layer),
                nbytes,
                flops,
                ceil,
                None,
                "the shared expert's own launches" if apart else "one launch each",
            )
        )
    return rows


def bench_projections(num_tokens: int, ceil: dict[str, float], gen: torch.Generator) -> list[dict[str, Any]]:
    import torch

    from kernels.moe_grouped_gemm import moe_grouped_gemm
    from kernels.quant_fp8 import quantize_act
    from services.worker.kernel_model.fp8_linear import linear_block_m, one_expert_meta

    rows = []
    meta = one_expert_meta(num_tokens, 1, torch.device(DEVICE))
    for label, (n, k) in projection_shapes().items():
        w, s = _random_weights(n, k, gen, 1)
        a = quantize_act(torch.randn(num_tokens, k, device=DEVICE, dtype=torch.bfloat16, generator=gen))
        nbytes = n * k + (n // 128) * (k // 128) * 4 + num_tokens * (k + 2 * n)
        for block_m in (16, 32):

            def call(bm: int = block_m) -> object:
                return moe_grouped_gemm(a, w, s, meta, gather=True, block_m=bm, num_warps=4)

            tag = " (engine)" if block_m == linear_block_m(num_tokens) else ""
            rows.append(
                _row(
                    f"projection {label} [BLOCK_M {block_m}]{tag}",
                    f"T={num_tokens} N={n} K={k}",
                    _bench_replay(call),
                    nbytes,
                    2.0 * num_tokens * n * k,
                    ceil,
                    None,
                    "one-expert FP8 GEMM",
                )
            )
    return rows


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for t in QUICK_TOKENS if quick else TOKENS:
        rows += bench_moe_layer(t, ceil, gen)
        rows += bench_projections(t, ceil, gen)
    return rows
