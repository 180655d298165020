"""Prefill's MoE experts through cuBLASLt's block-scaled GEMM (services/worker/kernel_model/block_scaled_gemm.py), one
expert at a time: ``KernelMoE``'s path for big eager steps (``applies``), in place of the masked grouped
Triton GEMM pair (``kernels.moe_grouped_gemm.moe_experts``).

The same maths as the Triton path: x quantised once by ``quantize_act`` (e4m3, one scale per token and 128
channels); each expert's gate/up product from its e4m3 weight and 128×128 block scales, in fp32; the SwiGLU
epilogue (gate clamped above, up clamped both sides, times the routing weight) in fp32, as the kernel
applies it to its accumulator; h quantised per token and 128 channels, as the kernel's e4m3 epilogue does;
the down product written in bf16, as the grouped GEMM writes it; the same combine kernel in the same order
(the shared expert first, then the routed picks in top-k order, in fp32). The two paths differ only in
summation order inside the products, in silu's formula (fp32 rounding), and so in the rare e4m3 or bf16
code that such a difference moves across a rounding boundary.

Per expert, because torch has no block-scaled grouped GEMM on sm_90 (``F.scaled_grouped_mm`` found no
implementation: shared/reference/h200-fp8-gemm-notes.md) and the experts' weights differ, so their rows
cannot share one matrix. Each expert's rows are made contiguous (one gather of all active experts' rows, in
expert order, each expert's rows padded to a multiple of ``block_scaled_gemm.ROW_ALIGN``), so a launch reads a
plain [count, K] block; the down outputs stay compact ([Σ counts, D'] plus the pads, ``slot_of`` remapped to
it), a seventh of the masked layout's [E+1, T, D'] at v41-s1 (top-6 + shared of 49).

The cost: one host read of the per-expert counts per layer (the launch sizes), which waits for the layer's
queued work and leaves the GPU idle while the first launches are issued; and four launches per active
expert (two GEMMs, two scale copies) against the grouped path's two per layer.
"""

from __future__ import annotations

import torch

from kernels import invariance
from model.deepseek_v41.moe import clamped_swiglu
from services.worker.kernel_model import block_scaled_gemm

MIN_ROWS_PER_EXPERT = 2048
"""Mean routed rows per expert from which the path is taken (and ``block_scaled_gemm.MIN_TOKENS`` tokens).
Chosen from ``shinkai bench kernels --only prefill_moe`` (v41-s1's layer, 48 + 1 experts, top 6;
docs/performance.md, "Kernels"): at 512 rows per expert (4K tokens) the per-expert layer was slower than the
grouped Triton GEMM (its down product lost more than its gate/up won); at 2,048 rows (16K tokens) it was faster
(both products won; the rest of its time is the per-layer count read, gathers and SwiGLU). So the path starts at
the measured win, 2,048 rows."""


def applies(num_tokens: int, top_k: int, num_experts: int, device: torch.device, interpreted: bool) -> bool:
    """Whether a ``KernelMoE`` step of ``num_tokens`` rows takes this path: prefill-sized (``MIN_TOKENS`` rows
    and ``MIN_ROWS_PER_EXPERT`` routed rows per expert on average), eager (the host reads the counts; a CUDA
    graph cannot), outside the batch-invariant mode (the kernel must not depend on the batch), compiled
    kernels, and a device whose probes passed for both output dtypes (fp32 gate/up, bf16 down)."""
    device = torch.device(device)
    return (
        num_tokens >= block_scaled_gemm.MIN_TOKENS
        and num_tokens * top_k >= MIN_ROWS_PER_EXPERT * num_experts
        and not invariance.active()
        and not interpreted
        and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())
        and block_scaled_gemm.available(device, torch.float32)
        and block_scaled_gemm.available(device, torch.bfloat16)
    )


def experts(
    x: torch.Tensor,
    meta: dict[str, torch.Tensor],
    w13: torch.Tensor,
    scale_b13: torch.Tensor,
    w2: torch.Tensor,
    scale_b2: torch.Tensor,
    swiglu_limit: float,
    quantize_act,
    combine,
) -> torch.Tensor:
    """x [T, D'] → fp32 [T, D'], every stacked expert of ``meta`` (``KernelMoE``'s layout, the shared expert
    last). w13 e4m3 [E+1, 2I', D'] (gate rows, then up rows) and w2 e4m3 [E+1, D', I'], with their scales in
    cuBLASLt's layout (``block_scaled_gemm.scale_b`` of the stacks). ``quantize_act`` and ``combine`` are the
    kernel set's (``quant_fp8.quantize_act``, ``moe_combine`` with the shared expert last). Rows routed nowhere
    (``slot_of`` 0) get any value; the caller masks them. Peak extra memory: the fp32 gate/up output twice
    (the per-expert pieces and their concatenation), 2·R·2I'·4 bytes, 2.1 GB at 8,192 v41-s1 tokens
    (``MOE_MAX_TOKENS``), against the grouped path's 4.1 GB masked bf16 down output."""
    num_stacked, capacity = meta["row_ids"].shape
    counts = meta["counts"].cpu()  # the one host read
    if not bool(counts.any()):  # no live row: nothing routed, nothing to combine
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    rows, starts, spans = compact_rows(counts, capacity)
    flat = rows.to(x.device)
    tokens = meta["row_ids"].reshape(-1)[flat].long()  # [R] the token of each compact row
    route_w = meta["route_w"].reshape(-1)[flat]  # [R]
    x_q, x_s = quantize_act(x)
    # [R, D'], [R, D'/128]: each expert's rows contiguous (e4m3 gathered as bytes: every index kernel has them)
    x_q, x_s = x_q.view(torch.uint8)[tokens].view(x_q.dtype), x_s[tokens]
    gate_up = torch.cat(
        [block_scaled_gemm.matmul((x_q[r], x_s[r]), w13[e], scale_b13[e], torch.float32) for e, r in spans]
    )  # fp32 [R, 2I']
    inter = gate_up.shape[1] // 2
    h_q, h_s = quantize_act(clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit) * route_w[:, None])
    del gate_up
    y = torch.cat(
        [block_scaled_gemm.matmul((h_q[r], h_s[r]), w2[e], scale_b2[e], torch.bfloat16) for e, r in spans]
    )  # bf16 [R, D']
    slot_of = meta["slot_of"]  # [T, k+1] flat masked slots e·capacity + j → compact rows start[e] + j
    compact = starts.to(x.device)[slot_of // capacity] + slot_of % capacity
    return combine(y, compact, True)


def compact_rows(counts: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor, list[tuple[int, slice]]]:
    """Host counts int [E+1] → (flat masked slots int64 [R] of the compact rows, each active expert's first
    compact row int64 [E+1], [(expert, its compact rows)]). An expert's span is its count rounded up to
    ``block_scaled_gemm.ROW_ALIGN`` rows (cuBLASLt's row multiple, so ``matmul`` copies nothing); the pad rows
    repeat the expert's slot 0, and nothing reads their outputs."""
    counts = counts.long()
    align = block_scaled_gemm.ROW_ALIGN
    spans_len = (counts + align - 1) // align * align  # [E+1]
    starts = torch.cumsum(spans_len, 0) - spans_len
    expert = torch.repeat_interleave(torch.arange(counts.numel()), spans_len)  # [R]
    j = torch.arange(expert.numel()) - starts[expert]  # place in the span
    rows = expert * capacity + torch.where(j < counts[expert], j, 0)
    spans = [(e, slice(int(starts[e]), int(starts[e] + spans_len[e]))) for e in range(counts.numel()) if counts[e]]
    return rows, starts, spans
