"""`shinkai bench kernels --only moe_splitk`: v41-s1's MoE experts at decode (48 routed, top-6, plus the shared
expert stacked last, which every row picks) through the one-pass grouped GEMM as ``KernelMoE`` runs it
(``moe_grouped_gemm.moe_experts``) and through the split-K variant (``kernels/moe_splitk.py``), on the same FP8
operands, at batch 1, 16 and 64: the whole layer (x's quantisation, gate/up + SwiGLU with e4m3 output, down,
the combine) and each GEMM alone, as graph replays with the L2 flushed (decode runs from graphs). Each GEMM is
also timed at every other split count that divides K/128 (the data for ``moe_splitk.num_splits``' rule).

Each row's TB/s is that of the weight bytes alone (e4m3 values and fp32 block scales of the active experts,
each read once): the MoE decode GEMMs' floor is reading them at HBM speed. Each size also checks the split-K
layer against the one pass and ``kernels.reference.moe_experts`` (relative Frobenius error, bar
``kernels_deepgemm_moe.LAYER_REL``); a failed check is marked ``ACCURACY FAIL`` in the note. Batch 64 is past
``moe_splitk.MAX_TOKENS`` (its rule keeps the one pass there): measured to show where the rule should stand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from services.bench.harness import DEVICE, _bench_replay, _row
from services.bench.kernels.decode_gemms import layer_meta
from services.bench.kernels.deepgemm_moe import LAYER_REL
from services.bench.kernels.run import EXPERTS, HIDDEN, INTER, SWIGLU_LIMIT, TOP_K, _random_weights

if TYPE_CHECKING:
    import torch

TOKENS = (1, 16, 64)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _weight_bytes(num_active: int, n_w: int, k: int) -> float:
    """e4m3 weights plus fp32 128×128 block scales of ``num_active`` experts, read once."""
    return num_active * n_w * k * (1 + 4 / 128**2)


def bench_size(num_tokens: int, ceil: dict[str, float], gen: torch.Generator) -> list[dict[str, Any]]:
    """The layer and each GEMM at one batch: the one pass (engine) then split-K, each pair on the same operands."""
    import torch

    from kernels import reference
    from kernels.moe_grouped_gemm import default_block_m, moe_experts, moe_grouped_gemm
    from kernels.moe_splitk import moe_experts_splitk, moe_grouped_gemm_splitk, num_splits, worth_splitting_experts
    from kernels.quant_fp8 import quantize_act

    num_stacked = EXPERTS + 1
    meta = layer_meta(num_tokens, gen)
    w13, s13 = _random_weights(2 * INTER, HIDDEN, gen, num_stacked)
    w2, s2 = _random_weights(HIDDEN, INTER, gen, num_stacked)
    x = torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
    active, picks = int(meta["num_active"]), num_tokens * (TOP_K + 1)
    shape = f"T={num_tokens} E={EXPERTS}+1 k={TOP_K} active={active}"
    picks_per_row = meta["slot_of"].shape[1]
    split13, split2 = (
        num_splits(INTER, HIDDEN, picks_per_row, x.device),
        num_splits(HIDDEN, INTER, picks_per_row, x.device),
    )
    rule = "rule: split-K" if worth_splitting_experts(meta, w13, w2) else "rule: one pass"

    weights = (w13, s13, w2, s2, SWIGLU_LIMIT)
    one_out = moe_experts(x, meta, *weights, shared_last=True)
    split_out = moe_experts_splitk(x, meta, *weights, shared_last=True)
    want = reference.moe_experts(x, meta, *weights, shared_last=True)
    rel, rel_one, rel_pair = _rel(split_out, want), _rel(one_out, want), _rel(split_out, one_out)
    verdict = "ok" if rel <= LAYER_REL else "ACCURACY FAIL"
    check = f"vs reference {rel:.2e} (one pass {rel_one:.2e}; {verdict} ≤ {LAYER_REL}), vs one pass {rel_pair:.2e}"

    layer_bytes = _weight_bytes(active, 3 * INTER, HIDDEN)
    layer_flops = 2.0 * picks * 3 * INTER * HIDDEN
    one_s = _bench_replay(lambda: moe_experts(x, meta, *weights, shared_last=True))
    split_s = _bench_replay(lambda: moe_experts_splitk(x, meta, *weights, shared_last=True))
    rows = [
        _row("moe layer [one pass] (engine)", shape, one_s, layer_bytes, layer_flops, ceil, None, "graph"),
        _row(
            "moe layer [split-K]",
            shape,
            split_s,
            layer_bytes,
            layer_flops,
            ceil,
            None,
            f"{one_s / split_s:.2f}x the one pass; splits gate/up {split13[0]}×{split13[1]} down "
            f"{split2[0]}×{split2[1]} K blocks; {rule}; {check}",
        ),
    ]

    # Each GEMM alone, the one pass at the engine's tile (moe_experts' block_m), the same operands for both.
    block_m = default_block_m(meta["slot_of"].numel() / num_stacked)
    x_q = quantize_act(x)
    h_q = moe_grouped_gemm(
        x_q, w13, s13, meta, gather=True, swiglu_limit=SWIGLU_LIMIT, out_dtype=torch.float8_e4m3fn, block_m=block_m
    )
    for name, kw, n_w, k, splits in (
        (
            "gate/up+swiglu fp8→fp8",
            dict(a=x_q, w=w13, w_scale=s13, gather=True, swiglu_limit=SWIGLU_LIMIT, out_dtype=torch.float8_e4m3fn),
            2 * INTER,
            HIDDEN,
            split13,
        ),
        ("down fp8→bf16", dict(a=h_q, w=w2, w_scale=s2, gather=False), HIDDEN, INTER, split2),
    ):

        def one_call(kw: dict = kw) -> object:
            return moe_grouped_gemm(meta=meta, block_m=block_m, **kw)

        def split_call(kw: dict = kw) -> object:
            return moe_grouped_gemm_splitk(meta=meta, **kw)

        nbytes, flops = _weight_bytes(active, n_w, k), 2.0 * picks * n_w * k
        one_s, split_s = _bench_replay(one_call), _bench_replay(split_call)
        gemm_shape = f"{shape} N={n_w} K={k}"
        rows.append(
            _row(
                f"moe {name} [one pass] (engine)",
                gemm_shape,
                one_s,
                nbytes,
                flops,
                ceil,
                None,
                f"graph, block_m {block_m}",
            )
        )
        rows.append(
            _row(
                f"moe {name} [split-K]",
                gemm_shape,
                split_s,
                nbytes,
                flops,
                ceil,
                None,
                f"{one_s / split_s:.2f}x the one pass; {splits[0]} splits of {splits[1]} K blocks (the rule's)",
            )
        )
        k_blocks = k // 128
        for other in (s for s in range(1, k_blocks + 1) if k_blocks % s == 0 and s != splits[0]):

            def swept(kw: dict = kw, other: int = other) -> object:
                return moe_grouped_gemm_splitk(meta=meta, splits=other, **kw)

            other_s = _bench_replay(swept)
            rows.append(
                _row(
                    f"moe {name} [split-K ×{other}]",
                    gemm_shape,
                    other_s,
                    nbytes,
                    flops,
                    ceil,
                    None,
                    f"{one_s / other_s:.2f}x the one pass; {other} splits of {k_blocks // other} K blocks",
                )
            )
    return rows


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for num_tokens in TOKENS:  # three sizes, each a few graph replays: quick changes nothing
        print(f"moe_splitk: batch {num_tokens}", flush=True)
        got = bench_size(num_tokens, ceil, gen)
        for r in got:  # as they come: a call cut short still leaves them in its log
            print(f"  {r['kernel']:40} {r['us']:9.1f} us {r['tb_s']:6.2f} TB/s weights  {r['note']}", flush=True)
        rows += got
    return rows
