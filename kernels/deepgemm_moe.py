"""A MoE layer's experts through DeepGEMM's grouped FP8 GEMMs (github.com/deepseek-ai/DeepGEMM, its sm_90 "1D2D"
kernels, JIT-compiled with nvcc on first use), taken by ``KernelMoE`` for prefill where ``deep_gemm`` imports and its
probe passes (``available``), unless ``SHINKAI_MOE_GEMM=triton``; otherwise the Triton grouped GEMM
(``kernels.moe_grouped_gemm``) stays.

Formats: DeepGEMM's sm_90 FP8 GEMM takes the kernels' own. Activations e4m3 [M, K] with one fp32 scale per token
and 128 channels ([M, K/128] row-major, as ``quant_fp8.quantize_act`` writes them: DeepGEMM moves them into its
TMA-aligned column-major layout itself); weights e4m3 [G, N, K] with fp32 128×128 block scales [G, N/128, K/128],
as ``KernelMoE`` holds its stacks (the checkpoint's 32×32 scales are converted at load, kernels/fp8_weights.py);
the output is bf16. The scales are powers of two already, so DeepGEMM's UE8M0 rounding (and packing, sm_100's
format) is switched off (``disable_ue8m0_cast``).

Two layouts of the stacked experts (``KernelMoE``'s E routed + the shared one as expert E):

- contiguous (prefill, ``contiguous_rows``): each expert's rows one after another, each span padded to DeepGEMM's
  M alignment (its block M), with ``m_indices`` int32 per row: the expert, −1 on pad rows. The spans follow the
  per-expert device counts inside a fixed M (``contiguous_size``: the most the spans can take), so the GPU never
  waits on the host. ``kernels.moe_contiguous`` writes the layout, each row's token, route weight and quantised
  activations, and the combine's slot map in one launch (two with ``quantize_act`` first: it picks the fewer
  bytes); ``contiguous_layout`` here is its torch reference (about 30 launches), which kernel sets without it run.
- masked (decode, ``masked=True``): the masked layout's [E+1, cap, K] grid itself, gathered from the token rows
  through ``row_ids`` (DeepGEMM reads A by TMA, with no row gather), ``masked_m`` = the device counts. Every shape
  is fixed per batch size: a CUDA graph can capture it once the kernels are compiled.

Between the products one launch (``quant_fp8.swiglu_quant``) applies the SwiGLU and the route weight to DeepGEMM's
bf16 gate/up output and quantises h per token and 128 channels (the Triton epilogue applies the same terms to
fp32 accumulators, the cuBLASLt path to fp32 output: the bf16 rounding, ≤ 2^-9 relative, is far below h's e4m3
step of 2^-4, but it moves the rare e4m3 code across a rounding boundary); the down product is bf16, and the
combine is the same kernel in the same order. DeepGEMM's tile choice follows M, so the path is not
batch-invariant: ``KernelMoE`` does not take it in that mode. ``KernelMoE`` takes the contiguous layout only (eager
prefill steps); the masked one stays for the kernel bench, where its layer lost to the Triton grouped GEMM's.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, NamedTuple

import torch

from kernels.reference import GROUP, dequantize_weight_block128

log = logging.getLogger(__name__)

ENV = "SHINKAI_MOE_GEMM"
"""``KernelMoE`` takes this path by default where ``deep_gemm`` imports and its probe passes (the FP8 KL test at v41
width passed with it: docs/performance.md); ``SHINKAI_MOE_GEMM=triton`` keeps the Triton grouped GEMM."""

MIN_TOKENS = 1024
"""``KernelMoE`` takes DeepGEMM from this many rows (tokens) in an eager step: prefill chunks. Below it the
contiguous layout's pad rows (up to an alignment block per expert) cost more than the GEMMs save."""

PROBE_REL = 2.0**-7
"""The probe's bound, relative Frobenius error of the bf16 output against the fp32 product of the same e4m3
operands and scales: the bf16 cast is ≤ 2^-9 relative (RMS about 1.7e-3 on random data); summation order inside
the fp32 accumulation is far below it. A wrong scale layout or a wrong expert is off by factors of 2 or more."""

Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
SwigluQuant = Callable[[torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]
Combine = Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor]


def requested() -> bool:
    """Whether the environment leaves DeepGEMM's MoE GEMMs on: unset or ``deepgemm``; ``triton`` keeps Triton."""
    return os.environ.get(ENV, "").strip().lower() in ("", "deepgemm")


@functools.cache
def module():
    """``deep_gemm``, imported once, or None where it is not installed (or fails to load)."""
    try:
        import deep_gemm  # type: ignore[import-not-found]  # built by scripts/gpu/deepgemm_build.sh
    except Exception as err:  # an ImportError, or the extension's own init failing (no CUDA home, …)
        log.info("deep_gemm does not import (%s): the MoE GEMMs stay on Triton", err)
        return None
    return deep_gemm


def alignment() -> int:
    """DeepGEMM's row alignment of the contiguous layout's spans (its block M for the grouped kernel)."""
    return int(module().get_mk_alignment_for_contiguous_layout())


@functools.cache
def available(device: torch.device) -> bool:
    """Whether ``deep_gemm`` imports and both grouped GEMMs agree with the exact product on ``device`` (a Hopper
    GPU), probed once per device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return available(torch.device("cuda", torch.cuda.current_device()))
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9 or module() is None:
        return False
    try:
        rel = _probe(device)
    except (RuntimeError, AssertionError) as err:  # a JIT compile failure or a rejected layout
        log.warning("DeepGEMM's grouped GEMM failed on %s (%s): the MoE GEMMs stay on Triton", device, err)
        return False
    if not max(rel) <= PROBE_REL:
        log.warning(
            "DeepGEMM's grouped GEMM disagrees on %s (relative errors %s > %.3g): the MoE GEMMs stay on Triton",
            device,
            rel,
            PROBE_REL,
        )
        return False
    log.info("MoE GEMMs: DeepGEMM (probe relative errors contiguous %.2g, masked %.2g)", *rel)
    return True


def _probe(device: torch.device) -> tuple[float, float]:
    """Relative errors of the contiguous and masked GEMMs on 3 experts of uneven counts (one empty)."""
    from kernels.fp8_weights import quantize_weight_block128
    from kernels.reference import quantize_act

    gen = torch.Generator(device=device).manual_seed(0)
    num_experts, n, k, capacity = 3, 256, 384, 80
    pairs = [quantize_weight_block128(torch.randn(n, k, device=device, generator=gen)) for _ in range(num_experts)]
    w = torch.stack([p[0] for p in pairs])  # [3, N, K]
    w_scale = torch.stack([p[1] for p in pairs])  # [3, N/128, K/128]
    a = quantize_act(torch.randn(num_experts, capacity, k, device=device, generator=gen))
    counts = torch.tensor([capacity, 0, 17], dtype=torch.int32)
    exact = exact_grouped(a, w, w_scale)  # [3, cap, N]
    masked = grouped_masked(a, w, w_scale, counts.to(device), capacity)
    flat, m_indices, starts = contiguous_rows(counts.to(device), capacity, alignment(), int(counts.sum()))
    contiguous = grouped_contiguous((a[0].flatten(0, 1)[flat], a[1].flatten(0, 1)[flat]), w, w_scale, m_indices)
    rows = [(e, int(starts[e]), c) for e, c in enumerate(counts.tolist()) if c]
    want = torch.cat([exact[e, :c] for e, _, c in rows])
    got_c = torch.cat([contiguous[s : s + c] for e, s, c in rows]).float()
    got_m = torch.cat([masked[e, :c] for e, _, c in rows]).float()
    return float((got_c - want).norm() / want.norm()), float((got_m - want).norm() / want.norm())


def exact_grouped(a: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [G, M, N] product of the dequantised operands a (e4m3 [G, M, K], fp32 [G, M, K/128]) and w (e4m3
    [G, N, K], fp32 [G, N/128, K/128]): what the grouped GEMMs compute up to summation order and the bf16 cast."""
    a_f = (a[0].float().unflatten(-1, (-1, GROUP)) * a[1].unsqueeze(-1)).flatten(-2)
    return torch.bmm(a_f, dequantize_weight_block128(w, w_scale).transpose(1, 2))


class ContiguousRows(NamedTuple):
    """The contiguous layout of ``experts``' first product, gathered: M rows (``contiguous_size``)."""

    a: tuple[torch.Tensor, torch.Tensor]
    """Each row's token, quantised: e4m3 [M, D'], fp32 [M, D'/128] (``quantize_act``'s bytes)."""
    m_indices: torch.Tensor
    """int32 [M]: each row's expert, −1 on pad rows."""
    tokens: torch.Tensor
    """int32 [M]: each row's token, 0 on pad rows."""
    route_w: torch.Tensor
    """fp32 [M]: each row's route weight, 0 on pad rows."""
    rows_of: torch.Tensor
    """int64 [T, k]: the contiguous row of each pick's slot (``contiguous_slots`` of ``slot_of``)."""


Layout = Callable[[torch.Tensor, dict, int], ContiguousRows]
"""(x [T, D'], ``KernelMoE``'s meta, the alignment) → ``ContiguousRows``: ``kernels.moe_contiguous``'s."""


def contiguous_size(num_slots: int, num_groups: int, align: int) -> int:
    """M, the contiguous layout's rows: the most that ``num_groups`` spans of ``num_slots`` slots in all can take,
    each padded to a multiple of ``align``, whatever the counts."""
    return (num_slots + num_groups * (align - 1) + align - 1) // align * align


def contiguous_rows(
    counts: torch.Tensor, capacity: int, align: int, num_slots: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Counts int [G] of a masked layout with ``capacity`` slots per expert, at most ``num_slots`` in all → (flat
    masked slots int64 [M], ``m_indices`` int32 [M], each expert's first contiguous row int64 [G]), on counts'
    device, with device ops only (no host read: the GPU never waits for the host between layers).

    Expert e's span is rows [starts[e], starts[e] + ⌈counts[e]/align⌉·align): its slots 0 … counts[e]−1 in
    order, then pad rows. M = ``contiguous_size``; rows past the last span are pad rows too. Pad rows have
    ``m_indices`` −1 (DeepGEMM skips a block whose first row is −1, and every span starts a block) and flat slot 0
    (any slot: callers mask them by ``m_indices``)."""
    num_groups = counts.numel()
    counts = counts.long()
    rows = contiguous_size(num_slots, num_groups, align)
    spans = (counts + align - 1) // align * align  # [G]
    starts = torch.cumsum(spans, 0) - spans
    j = torch.arange(capacity, device=counts.device)
    real = j < counts[:, None]  # [G, cap]
    dest = torch.where(real, starts[:, None] + j, rows).flatten()  # row M: a dump, cut off below
    flat = torch.zeros(rows + 1, dtype=torch.long, device=counts.device)
    flat.scatter_(0, dest, torch.arange(num_groups * capacity, device=counts.device))
    m_indices = torch.full((rows + 1,), -1, dtype=torch.int32, device=counts.device)
    m_indices.scatter_(
        0, dest, torch.arange(num_groups, dtype=torch.int32, device=counts.device).repeat_interleave(capacity)
    )
    return flat[:rows], m_indices[:rows], starts


def contiguous_slots(slot_of: torch.Tensor, starts: torch.Tensor, capacity: int) -> torch.Tensor:
    """``slot_of`` int [T, k] flat masked slots e·capacity + j → contiguous rows starts[e] + j (same shape)."""
    return starts.to(slot_of.device)[slot_of // capacity] + slot_of % capacity


def contiguous_layout(
    x: torch.Tensor, meta: dict[str, torch.Tensor], align: int, quantize_act: Quantize
) -> ContiguousRows:
    """The torch form of ``kernels.moe_contiguous.contiguous_layout`` (its reference): ``contiguous_rows``, x
    quantised, then its rows gathered. Pad rows gather token 0 and weigh 0 (a masked slot past its count holds
    any bytes, even a bad token id: it is never read)."""
    capacity = meta["row_ids"].shape[1]
    flat, m_indices, starts = contiguous_rows(meta["counts"], capacity, align, meta["slot_of"].numel())
    real = m_indices >= 0
    tokens = torch.where(real, meta["row_ids"].reshape(-1)[flat], 0).to(torch.int32)  # [M]
    x_q, x_s = quantize_act(x)  # [T, D'], [T, D'/128]
    index = tokens.long()
    a = (x_q.view(torch.uint8)[index].view(x_q.dtype), x_s[index])  # e4m3 gathered as bytes
    route_w = torch.where(real, meta["route_w"].reshape(-1)[flat], 0.0)
    return ContiguousRows(a, m_indices, tokens, route_w, contiguous_slots(meta["slot_of"], starts, capacity))


def grouped_contiguous(
    a: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor, w_scale: torch.Tensor, m_indices: torch.Tensor
) -> torch.Tensor:
    """a (e4m3 [M, K], fp32 [M, K/128]) rows of ``contiguous_rows``' layout, w e4m3 [G, N, K] with fp32 [G, N/128,
    K/128] scales, ``m_indices`` int32 [M] → bf16 [M, N]: row r times w[m_indices[r]] (pad rows: any value)."""
    out = torch.empty(a[0].shape[0], w.shape[1], dtype=torch.bfloat16, device=a[0].device)
    module().m_grouped_fp8_gemm_nt_contiguous(
        (a[0].contiguous(), a[1].contiguous()), (w, w_scale), out, m_indices.contiguous(), disable_ue8m0_cast=True
    )
    return out


def grouped_masked(
    a: tuple[torch.Tensor, torch.Tensor],
    w: torch.Tensor,
    w_scale: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
) -> torch.Tensor:
    """a (e4m3 [G, cap, K], fp32 [G, cap, K/128]), w e4m3 [G, N, K] with fp32 [G, N/128, K/128] scales,
    ``masked_m`` int32 [G] (device: rows per expert) → bf16 [G, cap, N], rows ≥ masked_m[g] unwritten.
    ``expected_m`` (rows per expert on average, a host int) only steers DeepGEMM's tile choice."""
    out = torch.empty(*a[0].shape[:2], w.shape[1], dtype=torch.bfloat16, device=a[0].device)
    module().m_grouped_fp8_gemm_nt_masked(
        (a[0].contiguous(), a[1].contiguous()),
        (w, w_scale),
        out,
        masked_m.to(torch.int32).contiguous(),
        max(1, int(expected_m)),
        disable_ue8m0_cast=True,
    )
    return out


def experts(
    x: torch.Tensor,
    meta: dict[str, torch.Tensor],
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: float,
    quantize_act: Quantize,
    swiglu_quant: SwigluQuant,
    combine: Combine,
    *,
    masked: bool,
    layout: Layout | None = None,
) -> torch.Tensor:
    """x [T, D'] → fp32 [T, D'], every stacked expert of ``meta`` (``KernelMoE``'s layout, the shared expert last),
    as ``kernels.moe_grouped_gemm.moe_experts`` computes it. w13 e4m3 [E+1, 2I', D'] (gate rows, then up rows),
    w2 e4m3 [E+1, D', I'], fp32 128×128 block scales. ``quantize_act``, ``swiglu_quant`` and ``combine`` are the
    kernel set's, ``layout`` its ``moe_contiguous.contiguous_layout`` (None: the torch ``contiguous_layout``).
    ``masked``: the masked layout; else the contiguous one. Both are device ops only (graph-safe)."""
    num_stacked, capacity = meta["row_ids"].shape
    if not masked:
        align = alignment()
        rows = contiguous_layout(x, meta, align, quantize_act) if layout is None else layout(x, meta, align)
        gate_up = grouped_contiguous(rows.a, w13, w13_scale, rows.m_indices)  # bf16 [M, 2I']
        h_q, h_s = swiglu_quant(gate_up, rows.route_w, swiglu_limit)  # [M, I'] e4m3
        del gate_up
        y = grouped_contiguous((h_q, h_s), w2, w2_scale, rows.m_indices)  # bf16 [M, D']
        return combine(y, rows.rows_of, True)
    x_q, x_s = quantize_act(x)  # [T, D'], [T, D'/128]
    counts = meta["counts"]
    # Slots ≥ counts are unwritten (any bytes): they gather token 0 and weigh 0, and nothing combines them.
    used = torch.arange(capacity, device=x.device) < counts.unsqueeze(1)  # [E+1, cap]
    rows = torch.where(used, meta["row_ids"], 0).long()
    a = (x_q.view(torch.uint8)[rows].view(x_q.dtype), x_s[rows])  # e4m3 gathered as bytes
    route_w = torch.where(used, meta["route_w"], 0.0)  # [E+1, cap]
    expected = max(1, meta["slot_of"].numel() // num_stacked)
    gate_up = grouped_masked(a, w13, w13_scale, counts, expected)  # bf16 [E+1, cap, 2I']
    inter = gate_up.shape[-1] // 2
    h_q, h_s = swiglu_quant(gate_up.reshape(-1, 2 * inter), route_w.reshape(-1), swiglu_limit)  # [(E+1)·cap, I'] e4m3
    del gate_up
    y = grouped_masked(
        (h_q.view(num_stacked, capacity, inter), h_s.view(num_stacked, capacity, -1)), w2, w2_scale, counts, expected
    )  # bf16 [E+1, cap, D']
    return combine(y, meta["slot_of"], True)
