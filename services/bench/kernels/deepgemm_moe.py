"""`shinkai bench kernels --only deepgemm_moe`: v41-s1's MoE experts (48 routed, top-6, plus the shared expert)
through DeepGEMM's grouped FP8 GEMMs (kernels/deepgemm_moe.py) beside the paths ``KernelMoE`` runs today, on the
same FP8 operands and scales:

- prefill, 1K/4K/16K tokens, DeepGEMM's contiguous layout: the whole layer (the layout and x's quantised rows
  from ``kernels.moe_contiguous``, both products, ``swiglu_quant``, the combine) against the same layer on the
  torch layout (``deepgemm_moe.contiguous_layout``), the grouped Triton pair and the cuBLASLt per-expert loop; the
  layout alone, the kernel both ways (``per_row``) against the torch form, each checked byte for byte; then each
  DeepGEMM product alone on gathered rows, beside ``kernels_prefill_moe.bench_products``' Triton and cuBLASLt
  rows. The layer's note gives the glue's share: the layer's time less both products'. Eager, L2 flushed, as
  prefill runs.
- decode, 64/256 rows, DeepGEMM's masked layout: the layer and each product as graph replays, against the
  Triton layer and its gate/up and down launches.

Every size also checks DeepGEMM against the exact fp32 product of the same operands (each product: relative
Frobenius error, bar ``deepgemm_moe.PROBE_REL``) and the whole layer against ``kernels.reference.moe_experts``
(bar ``LAYER_REL``, with the Triton layer's own error beside it); the rows' notes carry the figures and a
failed check is marked ``ACCURACY FAIL``. Sizes run in order of interest (4K prefill first) and stop at
``DEADLINE_S`` seconds after the first, so that one device call always finishes and reports what it measured.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

from services.bench.harness import DEVICE, _bench, _bench_replay, _row
from services.bench.kernels.decode_gemms import layer_meta
from services.bench.kernels.run import EXPERTS, HIDDEN, INTER, SWIGLU_LIMIT, TOP_K, _random_weights

if TYPE_CHECKING:
    import torch

CASES = (("prefill", 4096), ("prefill", 16384), ("decode", 256), ("prefill", 1024), ("decode", 64))
QUICK_CASES = (("prefill", 4096), ("decode", 256))
ENV_CASES = os.environ.get("SHINKAI_DEEPGEMM_CASES", "")
"""``kind:tokens`` pairs, comma-separated (e.g. ``decode:1,decode:16``): these cases instead of the mode's."""
DEADLINE_S = float(os.environ.get("SHINKAI_DEEPGEMM_BENCH_S", "330"))
"""Seconds after which no further size starts (DeepGEMM compiles each new kernel with nvcc on first use)."""
LAYER_REL = 0.05
"""The layer check's bar, tests/tolerances.py's FP8_LINEAR_REL (services import nothing from tests): the layer
differs from the reference by h's e4m3 codes that the bf16 gate/up moves, at most one e4m3 cast's RMS error
(3.25%), plus bf16 casts far below it."""


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def _layer_check(x: torch.Tensor, meta: dict, weights: tuple, deep: torch.Tensor, triton_out: torch.Tensor) -> str:
    """The layer against the torch reference: DeepGEMM's and Triton's relative errors, and the verdict."""
    from kernels import reference

    w13, s13, w2, s2 = weights
    want = reference.moe_experts(x, meta, w13, s13, w2, s2, SWIGLU_LIMIT, shared_last=True)
    deep_rel, triton_rel = _rel(deep, want), _rel(triton_out, want)
    verdict = "ok" if deep_rel <= LAYER_REL else "ACCURACY FAIL"
    return f"layer vs reference: DeepGEMM {deep_rel:.2e}, Triton {triton_rel:.2e} ({verdict} ≤ {LAYER_REL})"


def _product_check(got: torch.Tensor, want: torch.Tensor) -> str:
    from kernels.deepgemm_moe import PROBE_REL

    rel = _rel(got, want)
    return f"vs exact {rel:.2e} ({'ok' if rel <= PROBE_REL else 'ACCURACY FAIL'} ≤ {PROBE_REL:.2e})"


class _LayerCase:
    """One size's routed layer on random FP8 operands: its routing, weights, input, traffic and work, the
    DeepGEMM layer in the given layout and the grouped Triton layer, and DeepGEMM's first (JIT) call's output."""

    def __init__(self, num_tokens: int, gen: torch.Generator, masked: bool) -> None:
        import torch

        from kernels import deepgemm_moe
        from kernels.moe_combine import moe_combine
        from kernels.moe_contiguous import contiguous_layout
        from kernels.moe_grouped_gemm import moe_experts
        from kernels.quant_fp8 import quantize_act, swiglu_quant

        self.num_stacked, self.picks = EXPERTS + 1, num_tokens * (TOP_K + 1)
        self.meta = meta = layer_meta(num_tokens, gen)
        self.weights = w13, s13, w2, s2 = (
            *_random_weights(2 * INTER, HIDDEN, gen, self.num_stacked),
            *_random_weights(HIDDEN, INTER, gen, self.num_stacked),
        )
        self.x = x = torch.randn(num_tokens, HIDDEN, device=DEVICE, dtype=torch.bfloat16, generator=gen)
        self.active = int(meta["num_active"])
        self.nbytes = (
            self.active * (3 * INTER * HIDDEN) * (1 + 4 / 128**2)
            + num_tokens * HIDDEN * 6
            + self.picks * (INTER + HIDDEN * 2)
        )
        self.flops = 2.0 * self.picks * 3 * INTER * HIDDEN
        self.shape = f"T={num_tokens} E={EXPERTS}+1 shared k={TOP_K} D={HIDDEN} I={INTER}"
        self.deep_layer = lambda layout=contiguous_layout: deepgemm_moe.experts(
            x,
            meta,
            w13,
            s13,
            w2,
            s2,
            SWIGLU_LIMIT,
            quantize_act,
            swiglu_quant,
            moe_combine,
            masked=masked,
            layout=layout,
        )  # the contiguous layout from the kernel; ``layout=None``: the torch form
        self.triton_layer = lambda: moe_experts(x, meta, w13, s13, w2, s2, SWIGLU_LIMIT, shared_last=True)
        t0 = time.perf_counter()
        self.deep_out = self.deep_layer()  # the JIT compiles here
        torch.cuda.synchronize()
        layout = "masked" if masked else "contiguous"
        print(f"  DeepGEMM {layout} layer, first call (nvcc JIT): {time.perf_counter() - t0:.1f} s", flush=True)

    def check(self, check: bool) -> str:
        """The layer check's note (or that it was skipped at this size)."""
        if not check:
            return "layer not checked"
        return _layer_check(self.x, self.meta, self.weights, self.deep_out, self.triton_layer())


def bench_prefill(num_tokens: int, ceil: dict[str, float], gen: torch.Generator, check: bool) -> list[dict[str, Any]]:
    import torch

    from kernels.moe_combine import moe_combine
    from kernels.quant_fp8 import quantize_act
    from services.bench.kernels.prefill_moe import bench_products
    from services.worker.kernel_model import block_scaled_experts, block_scaled_gemm

    case = _LayerCase(num_tokens, gen, masked=False)
    meta, x, (w13, s13, w2, s2) = case.meta, case.x, case.weights
    shape, nbytes, flops = case.shape, case.nbytes, case.flops
    deep_layer, triton_layer = case.deep_layer, case.triton_layer
    note = case.check(check)
    deep_s, triton_s = _bench(deep_layer), _bench(triton_layer)
    torch_layout_s = _bench(lambda: deep_layer(None))
    layer = _row(
        "prefill moe layer [DeepGEMM contiguous]",
        shape,
        deep_s,
        nbytes,
        flops,
        ceil,
        None,
        f"{triton_s / deep_s:.2f}x the grouped Triton pair; {note}",
    )
    rows = [
        layer,
        _row(
            "prefill moe layer [DeepGEMM contiguous, torch layout]",
            shape,
            torch_layout_s,
            nbytes,
            flops,
            ceil,
            None,
            f"{torch_layout_s / deep_s:.2f}x the layer on kernels.moe_contiguous",
        ),
        _row("prefill moe layer [grouped Triton]", shape, triton_s, nbytes, flops, ceil, None, ""),
    ]
    rows += _layout_rows(x, meta, ceil)
    cublas = block_scaled_gemm.available(torch.device(DEVICE), torch.float32) and block_scaled_gemm.available(
        torch.device(DEVICE), torch.bfloat16
    )
    if cublas:
        scale_b13, scale_b2 = block_scaled_gemm.scale_b(s13), block_scaled_gemm.scale_b(s2)
        cublas_s = _bench(
            lambda: block_scaled_experts.experts(
                x, meta, w13, scale_b13, w2, scale_b2, SWIGLU_LIMIT, quantize_act, moe_combine
            )
        )
        rows.append(
            _row(
                "prefill moe layer [cuBLASLt per expert]",
                shape,
                cublas_s,
                nbytes,
                flops,
                ceil,
                None,
                f"{cublas_s / deep_s:.2f}x DeepGEMM's time",
            )
        )
    products = _deep_products(num_tokens, meta, (w13, s13), (w2, s2), x, ceil)
    glue_us = layer["us"] - sum(r["us"] for r in products)
    layer["note"] = f"glue (layer less both products) {glue_us:.0f} us, {glue_us / layer['us']:.0%}; " + layer["note"]
    rows += products
    if cublas:
        rows += bench_products(num_tokens, meta, (w13, s13, scale_b13), (w2, s2, scale_b2), x, ceil)
    return rows


def _layout_rows(x: torch.Tensor, meta: dict, ceil: dict[str, float]) -> list[dict[str, Any]]:
    """The contiguous layout alone: ``kernels.moe_contiguous`` both ways (``per_row``) against the torch form it
    replaces (``deepgemm_moe.contiguous_layout``), each checked against it byte for byte on every row DeepGEMM
    reads. Bytes: x once and the spans' quantised rows once (either way moves more)."""
    import torch

    from kernels import deepgemm_moe, moe_contiguous
    from kernels.quant_fp8 import quantize_act

    align = deepgemm_moe.alignment()
    picks = meta["slot_of"].numel()
    spans = int(((meta["counts"].long() + align - 1) // align * align).sum())

    def torch_layout() -> deepgemm_moe.ContiguousRows:
        return deepgemm_moe.contiguous_layout(x, meta, align, quantize_act)

    want = torch_layout()
    torch_s = _bench(torch_layout)
    nbytes = x.numel() * x.element_size() + spans * x.shape[1] * moe_contiguous.SCALE_BYTES
    shape = f"T={x.shape[0]} picks={picks} M={want.m_indices.numel()} spans={spans} D={x.shape[1]}"
    default = moe_contiguous.quantizes_per_row(x, picks)
    rows = []
    for per_row, how in ((False, "quantise then gather"), (True, "quantise per row")):

        def call(per_row: bool = per_row) -> deepgemm_moe.ContiguousRows:
            return moe_contiguous.contiguous_layout(x, meta, align, per_row=per_row)

        got = call()
        same = all(
            torch.equal(getattr(got, name), getattr(want, name))
            for name in ("m_indices", "tokens", "route_w", "rows_of")
        )
        same = same and all(
            torch.equal(g[:spans].view(torch.uint8), w[:spans].view(torch.uint8)) for g, w in zip(got.a, want.a)
        )
        rows.append(
            _row(
                f"prefill moe layout [Triton, {how}]",
                shape,
                _bench(call),
                nbytes,
                0.0,
                ceil,
                torch_s,
                f"{'the default; ' if per_row == default else ''}vs the torch layout: "
                f"{'byte-equal (ok)' if same else 'ACCURACY FAIL'}",
            )
        )
    rows.append(
        _row(
            "prefill moe layout [torch]",
            shape,
            torch_s,
            nbytes,
            0.0,
            ceil,
            None,
            "contiguous_rows, quantize_act, the gathers, contiguous_slots",
        )
    )
    return rows


def _deep_products(
    num_tokens: int, meta: dict, gate_up: tuple, down: tuple, x: torch.Tensor, ceil: dict[str, float]
) -> list[dict[str, Any]]:
    """Each DeepGEMM product alone on rows already gathered into the contiguous layout (bf16 output), each
    checked against the exact product of its rows' experts."""
    import torch

    from kernels import deepgemm_moe
    from kernels.quant_fp8 import quantize_act

    picks = num_tokens * (TOP_K + 1)
    counts = meta["counts"].cpu()
    flat, m_indices, starts = deepgemm_moe.contiguous_rows(meta["counts"], num_tokens, deepgemm_moe.alignment(), picks)
    starts = starts.cpu()
    x_q, x_s = quantize_act(x)
    tokens = torch.where(m_indices >= 0, meta["row_ids"].reshape(-1)[flat], 0).long()
    a = (x_q.view(torch.uint8)[tokens].view(x_q.dtype), x_s[tokens])
    h = quantize_act(torch.randn(flat.numel(), INTER, device=DEVICE, dtype=torch.bfloat16))
    rows = []
    shape = f"T={num_tokens} E={EXPERTS}+1 shared k={TOP_K} M={flat.numel()}"
    for name, (w, s), operand, n, k in (("gate/up", gate_up, a, 2 * INTER, HIDDEN), ("down", down, h, HIDDEN, INTER)):

        def call(w: torch.Tensor = w, s: torch.Tensor = s, operand: tuple = operand) -> torch.Tensor:
            return deepgemm_moe.grouped_contiguous(operand, w, s, m_indices)

        got = call()
        e = int(torch.argmax(counts))  # the busiest expert (the shared one): its rows checked exactly
        span = slice(int(starts[e]), int(starts[e]) + int(counts[e]))
        want = deepgemm_moe.exact_grouped((operand[0][span][None], operand[1][span][None]), w[e : e + 1], s[e : e + 1])[
            0
        ]
        flops = 2.0 * picks * n * k
        nbytes = int(meta["num_active"]) * n * k + picks * (k + 2 * n)
        rows.append(
            _row(
                f"prefill moe {name} [DeepGEMM contiguous]",
                f"{shape} N={n} K={k}",
                _bench(call),
                nbytes,
                flops,
                ceil,
                None,
                f"bf16 out, expert {e} {_product_check(got[span], want)}",
            )
        )
    return rows


def bench_decode(num_tokens: int, ceil: dict[str, float], gen: torch.Generator, check: bool) -> list[dict[str, Any]]:
    import torch

    from kernels import deepgemm_moe
    from kernels.quant_fp8 import quantize_act

    case = _LayerCase(num_tokens, gen, masked=True)
    meta, x, (w13, s13, w2, s2) = case.meta, case.x, case.weights
    shape, nbytes, flops = case.shape, case.nbytes, case.flops
    num_stacked, picks, active = case.num_stacked, case.picks, case.active
    deep_layer, triton_layer = case.deep_layer, case.triton_layer
    note = case.check(check)
    deep_s, how = _replay_or_eager(deep_layer)
    triton_s = _bench_replay(triton_layer)
    rows = [
        _row(
            "decode moe layer [DeepGEMM masked]",
            shape,
            deep_s,
            nbytes,
            flops,
            ceil,
            None,
            f"{how}; {triton_s / deep_s:.2f}x the Triton layer; {note}",
        ),
        _row("decode moe layer [grouped Triton] (engine)", shape, triton_s, nbytes, flops, ceil, None, "graph"),
    ]
    # Each product alone: DeepGEMM on the gathered [E+1, T, K] grid against the Triton launch as the engine makes it.
    from kernels.moe_grouped_gemm import moe_grouped_gemm

    x_q = quantize_act(x)
    used = torch.arange(num_tokens, device=DEVICE) < meta["counts"].unsqueeze(1)
    rows_idx = torch.where(used, meta["row_ids"], 0).long()
    a = (x_q[0].view(torch.uint8)[rows_idx].view(x_q[0].dtype), x_q[1][rows_idx])
    h_q, h_s = quantize_act(torch.randn(num_stacked * num_tokens, INTER, device=DEVICE, dtype=torch.bfloat16))
    h = (h_q.view(num_stacked, num_tokens, INTER), h_s.view(num_stacked, num_tokens, -1))
    expected = max(1, picks // num_stacked)
    for name, (w, s), operand, n, k, triton_kw in (
        (
            "gate/up",
            (w13, s13),
            a,
            2 * INTER,
            HIDDEN,
            dict(a=x_q, gather=True, swiglu_limit=SWIGLU_LIMIT, out_dtype=torch.float8_e4m3fn),
        ),
        ("down", (w2, s2), h, HIDDEN, INTER, dict(a=h, gather=False)),
    ):

        def call(w: torch.Tensor = w, s: torch.Tensor = s, operand: tuple = operand) -> torch.Tensor:
            return deepgemm_moe.grouped_masked(operand, w, s, meta["counts"], expected)

        def triton_call(w: torch.Tensor = w, s: torch.Tensor = s, kw: dict = triton_kw) -> object:
            return moe_grouped_gemm(w=w, w_scale=s, meta=meta, **kw)

        got = call()
        e = num_stacked - 1  # the shared expert: every row
        want = deepgemm_moe.exact_grouped((operand[0][e : e + 1], operand[1][e : e + 1]), w[e : e + 1], s[e : e + 1])[0]
        flops = 2.0 * picks * n * k
        nbytes_p = active * n * k + picks * (k + 2 * n)
        deep_s, how = _replay_or_eager(call)
        triton_s = _bench_replay(triton_call)
        rows.append(
            _row(
                f"decode moe {name} [DeepGEMM masked]",
                f"{shape} N={n} K={k}",
                deep_s,
                nbytes_p,
                flops,
                ceil,
                None,
                f"{how}; {triton_s / deep_s:.2f}x Triton's; bf16 out, expert {e} {_product_check(got[e], want)}",
            )
        )
        rows.append(
            _row(
                f"decode moe {name} [grouped Triton] (engine)",
                f"{shape} N={n} K={k}",
                triton_s,
                nbytes_p,
                flops,
                ceil,
                None,
                "graph" + (", SwiGLU epilogue, e4m3 out" if name == "gate/up" else ""),
            )
        )
    return rows


def _replay_or_eager(fn) -> tuple[float, str]:
    """Graph-replay seconds, or eager seconds where the capture fails (the note says which)."""
    try:
        return _bench_replay(fn), "graph"
    except RuntimeError as err:
        print(f"  capture failed ({err}); timed eagerly", flush=True)
        return _bench(fn), "EAGER (capture failed)"


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    import torch

    from kernels import deepgemm_moe

    if not deepgemm_moe.available(torch.device(DEVICE)):
        print(
            "deepgemm_moe: deep_gemm is not installed or its probe failed here "
            "(scripts/gpu/deepgemm_build.sh builds it); "
            "nothing measured",
            flush=True,
        )
        return []
    rows: list[dict[str, Any]] = []
    start = time.perf_counter()
    cases = [(k, int(t)) for k, t in (c.split(":") for c in ENV_CASES.split(",") if c)] if ENV_CASES else None
    for kind, num_tokens in cases or (QUICK_CASES if quick else CASES):
        if time.perf_counter() - start > DEADLINE_S:
            print(f"deepgemm_moe: {kind} {num_tokens} skipped (past {DEADLINE_S:.0f} s)", flush=True)
            continue
        print(f"deepgemm_moe: {kind} {num_tokens} tokens", flush=True)
        run = bench_prefill if kind == "prefill" else bench_decode
        try:
            got = run(num_tokens, ceil, gen, check=num_tokens <= 4096)
            for r in got:  # as they come: a call cut short still leaves them in its log
                print(f"  {r['kernel']:44} {r['us']:9.1f} us {r['tflop_s']:7.1f} TFLOP/s  {r['note']}", flush=True)
            rows += got
        except Exception as exc:  # one size's failure is reported; the others are still measured
            import traceback

            traceback.print_exc()
            rows.append(
                _row(
                    f"deepgemm_moe {kind} {num_tokens} FAILED",
                    type(exc).__name__,
                    float("nan"),
                    0.0,
                    0.0,
                    ceil,
                    None,
                    str(exc)[:300],
                )
            )
        torch.cuda.empty_cache()
    return rows
