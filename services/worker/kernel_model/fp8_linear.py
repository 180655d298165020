"""Kernel-backed linear layers (the kernel modules they call: ``KernelSet``, kernel_set.py).

FP8 linear: the weight is e4m3 with one fp32 power-of-two scale per 128×128 block
(``kernels.fp8_weights.quantize_weight_block128``), the activations are quantised per token and per
128 channels by ``kernels.quant_fp8.quantize_act``, and the product runs on the MoE grouped GEMM
kernel as a one-expert GEMM (``counts = [T]``, the slot → token map the identity). Products of
``block_scaled_gemm.LINEAR_MIN_TOKENS`` rows or more (prefill, and decode's larger batches inside their CUDA
graphs; for the grouped wo_a, one GEMM a group) take cuBLASLt's block-scaled GEMM instead
(services/worker/kernel_model/block_scaled_gemm.py: the same operands and scales, the output in the activations' dtype,
Hopper tiles), where the grouped GEMM's one-expert grid is
only N/128 programs wide and re-reads the weights every BLOCK_M rows; smaller decode batches, the
batch-invariant mode and the interpreter stay on the Triton GEMM.

Dimensions that are not multiples of 128 (the tiny presets) are zero-padded at conversion: padded
weight rows/columns are 0, padded activation channels are 0, so every product and every block
amax is unchanged (exact); outputs are sliced back.

``precision="fp32"`` keeps the dequantised fp32 weight and runs a plain matmul (the GEMM kernel has
no fp32-weight mode): the same module structure, for numerics tests against the CPU reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import invariance
from kernels.fp8_weights import quantize_weight_block128
from kernels.quant_fp8 import IN_GEMM_MAX_ROWS
from kernels.reference import GROUP, dequantize_weight_block128
from services.worker.kernel_model import block_scaled_gemm
from services.worker.kernel_model.kernel_set import KernelSet

PRECISIONS = ("fp8", "fp32")


def linear_block_m(num_tokens: int) -> int:
    """Tokens per MMA tile (``invariance.BLOCK_M`` at every size in the batch-invariant mode) of the one-expert GEMM
    (4 warps by default). 16 up to decode's 256 rows; above, 32: the weights are re-read once per tile, and at 1K–4K
    tokens BLOCK_M 32 took clearly less time than BLOCK_M 16 summed over v41's projections
    (``scripts/diagnostics/tune_linear.py``; docs/performance.md, "Kernels", has the table). 0 spills at both
    (ptxas sm_90a, scripts/dev/compile_sm90.py); BLOCK_M 64 spills at 4 warps."""
    if invariance.active():
        return invariance.BLOCK_M
    return 16 if num_tokens <= 256 else 32


def round_up(n: int, multiple: int = GROUP) -> int:
    return -(-n // multiple) * multiple


def pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dim of x to ``size`` (no copy when it already has that size)."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def pad_matrix(w: torch.Tensor) -> torch.Tensor:
    """fp32 [..., N, K] → [..., N', K'] zero-padded to multiples of 128."""
    n, k = w.shape[-2:]
    return F.pad(w.float(), (0, round_up(k) - k, 0, round_up(n) - n))


def quantize_padded(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fp32 [..., N, K] → (e4m3 [..., N', K'], fp32 scales [..., N'/128, K'/128], #elements not exact)."""
    padded = pad_matrix(w)
    q, scale = quantize_weight_block128(padded)
    inexact = int((dequantize_weight_block128(q, scale) != padded).sum())
    return q, scale, inexact


def quantize_each(count: int, matrix) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``quantize_padded`` of the stack of ``matrix(i)`` (fp32 [N, K]) for i < count, one at a time into
    preallocated outputs: bit-identical to quantizing the stack (the 128×128 blocks never span two
    matrices), with one matrix's fp32 copies as the transient instead of the stack's several (a
    v41-s1 layer's 49 experts: ~25 GB at the whole-stack peak, which its 40-layer build cannot spare)."""
    first_q, first_scale, inexact = quantize_padded(matrix(0)[None])
    q = torch.empty((count, *first_q.shape[1:]), dtype=first_q.dtype, device=first_q.device)
    scale = torch.empty((count, *first_scale.shape[1:]), dtype=first_scale.dtype, device=first_scale.device)
    q[0], scale[0] = first_q[0], first_scale[0]
    for i in range(1, count):
        qi, si, bad = quantize_padded(matrix(i)[None])
        q[i], scale[i], inexact = qi[0], si[0], inexact + bad
    return q, scale, inexact


_META_CACHE: dict[tuple[int, int, torch.device], dict[str, torch.Tensor]] = {}
META_CACHE_MAX_TOKENS = 1024
"""``one_expert_meta`` keeps its tensors for token counts up to this (every decode graph size); they are
never evicted, because a captured graph reads them by address. Above it (eager prefill steps, whose
sizes vary without bound) they are built per call."""


def one_expert_meta(num_tokens: int, num_experts: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``route_metadata`` of every token in every one of ``num_experts`` experts with weight 1 (slot j of
    expert e is token j): a dense GEMM, or the G groups of a grouped projection. Device ops only.

    Read-only constants of (num_tokens, num_experts): built once per size up to
    ``META_CACHE_MAX_TOKENS``. Built per call, they cost ~9 small launches per projection, about 1,800
    per v41-s1 decode step (a share of batch 1's small torch launches: docs/performance.md, "Decode step")."""
    key = (num_tokens, num_experts, torch.device(device))
    meta = _META_CACHE.get(key)
    if meta is not None:
        return meta
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=device)
    meta = {
        "counts": torch.full((num_experts,), num_tokens, dtype=torch.int32, device=device),
        "row_ids": tokens.expand(num_experts, num_tokens).contiguous(),
        "route_w": torch.ones(num_experts, num_tokens, dtype=torch.float32, device=device),
        "slot_of": tokens.long().view(num_tokens, 1).expand(num_tokens, num_experts).contiguous(),
        "active": torch.arange(num_experts, dtype=torch.int32, device=device),
        "num_active": torch.full((1,), num_experts if num_tokens else 0, dtype=torch.int32, device=device),
    }
    if num_tokens <= META_CACHE_MAX_TOKENS and not _capturing(device):
        _META_CACHE[key] = meta
    return meta


_GROUP_ROWS_CACHE: dict[tuple[int, int, torch.device], dict[str, torch.Tensor]] = {}


def group_rows_meta(num_tokens: int, num_groups: int, device: torch.device) -> dict[str, torch.Tensor]:
    """``one_expert_meta(num_tokens, num_groups)`` but slot j of group g reads row j·G + g: the G groups of
    x [T, G, Kg] gathered in place from its [T·G, Kg] view (no [G, T, Kg] transposed copy). Cached as
    ``one_expert_meta`` is, up to ``META_CACHE_MAX_TOKENS`` tokens."""
    key = (num_tokens, num_groups, torch.device(device))
    meta = _GROUP_ROWS_CACHE.get(key)
    if meta is not None:
        return meta
    tokens = torch.arange(num_tokens, dtype=torch.int32, device=device)
    groups = torch.arange(num_groups, dtype=torch.int32, device=device)
    meta = {
        **one_expert_meta(num_tokens, num_groups, device),
        "row_ids": (tokens[None, :] * num_groups + groups[:, None]).contiguous(),
    }  # [G, T]
    if num_tokens <= META_CACHE_MAX_TOKENS and not _capturing(device):
        _GROUP_ROWS_CACHE[key] = meta
    return meta


def activations(
    kernels: KernelSet, x: torch.Tensor, num_tokens: int
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What a linear's GEMM takes for x [R, K] (K % 128 == 0, dense), of which each expert (the one
    projection, or each group of a grouped one) reads ``num_tokens`` rows: x itself, quantised inside the
    GEMM, when num_tokens ≤ ``quant_fp8.IN_GEMM_MAX_ROWS`` (decode); else ``quantize_act``'s (e4m3, scales)
    pair, quantised once for every N tile (prefill, and cuBLASLt's block-scaled GEMM, which takes only it)."""
    if num_tokens <= IN_GEMM_MAX_ROWS:
        return x
    return kernels.quant_fp8.quantize_act(x)


def _capturing(device: torch.device) -> bool:
    """Tensors made inside a CUDA graph capture live in its private pool: not kept past it."""
    return torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing()


def takes_block_scaled(
    kernels: KernelSet, num_tokens: int, min_tokens: int, x: torch.Tensor, out_dtype: torch.dtype
) -> bool:
    """``min_tokens`` rows or more (per group of a grouped projection) on a compiled kernel set, outside the
    batch-invariant mode: cuBLASLt's block-scaled GEMM, with the output in the activations' dtype (bf16 or fp32)
    where the device's probe for that dtype passed."""
    return (
        num_tokens >= min_tokens
        and x.dtype in block_scaled_gemm.OUT_DTYPES
        and not invariance.active()
        and not kernels.interpreted
        and block_scaled_gemm.available(x.device, out_dtype)
    )


def _scale_b(cached: torch.Tensor | None, w_scale: torch.Tensor) -> torch.Tensor:
    """``cached`` where it is ``w_scale`` in cuBLASLt's layout on ``w_scale``'s device, else made again (a module
    moved to another device)."""
    if cached is None or cached.device != w_scale.device:
        return block_scaled_gemm.scale_b(w_scale)
    return cached


class KernelLinear(nn.Module):
    """``y = x · Wᵀ`` for W [N, K] (an nn.Linear without bias), x [..., K] → [..., N] in x.dtype."""

    def __init__(self, weight: torch.Tensor, precision: str, kernels: KernelSet) -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision, self.kernels = precision, kernels
        self.out_features, self.in_features = weight.shape
        self.inexact = 0
        self.scale_b: torch.Tensor | None = None  # w_scale in cuBLASLt's layout, made on first use per device
        if precision == "fp8":
            q, scale, self.inexact = quantize_padded(weight.detach()[None])
            self.register_buffer("w", q)  # e4m3 [1, N', K']
            self.register_buffer("w_scale", scale)  # fp32 [1, N'/128, K'/128]
        else:
            self.register_buffer("w", weight.detach().float().clone())  # fp32 [N, K]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.precision == "fp32":
            return F.linear(x.float(), self.w).to(x.dtype)
        x2 = pad_last(x.reshape(-1, self.in_features), self.w.shape[-1])  # [T, K']
        num_tokens = x2.shape[0]
        if num_tokens == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features)
        gemm = self.kernels.moe_grouped_gemm
        out_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
        a = activations(self.kernels, x2.contiguous(), num_tokens)
        if takes_block_scaled(self.kernels, num_tokens, block_scaled_gemm.LINEAR_MIN_TOKENS, x, out_dtype):
            self.scale_b = _scale_b(self.scale_b, self.w_scale[0])
            y = block_scaled_gemm.matmul(a, self.w[0], self.scale_b, out_dtype)  # [T, N']
        elif (
            hasattr(gemm, "fp8_linear_splitk")
            and num_tokens <= gemm.SPLITK_MAX_TOKENS
            and not invariance.active()
            and gemm.worth_splitting(self.w.shape[1], x.device)
        ):
            # Decode's few rows on a projection with few N tiles: K split over programs (kernels/fp8_splitk.py);
            # not in the batch-invariant mode, where the batch must not choose the kernel.
            y = gemm.fp8_linear_splitk(a, self.w, self.w_scale, out_dtype=out_dtype)  # [T, N']
        else:
            y = gemm.moe_grouped_gemm(
                a,
                self.w,
                self.w_scale,
                one_expert_meta(num_tokens, 1, x.device),
                gather=True,
                out_dtype=out_dtype,
                block_m=linear_block_m(num_tokens),
            )[0]
        return y[:, : self.out_features].to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, precision={self.precision}"


class GroupedKernelLinear(nn.Module):
    """Attention's ``wo_a``: G independent blocks W_g [R, Kg] (rows g·R … of the stored [G·R, Kg]);
    x [..., G, Kg] → [..., G·R], the model's ``einsum("bsgi,gri->bsgr")`` flattened. FP8: the grouped
    GEMM with G experts, every token in each (group g's rows gathered from the input's [T·G, Kg'] rows); from
    ``GROUPED_MIN_TOKENS`` tokens (``takes_block_scaled``), G of cuBLASLt's block-scaled GEMMs, one a group."""

    def __init__(self, weight: torch.Tensor, num_groups: int, precision: str, kernels: KernelSet) -> None:
        super().__init__()
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.precision, self.kernels, self.num_groups = precision, kernels, num_groups
        grouped = weight.detach().float().view(num_groups, -1, weight.shape[-1])  # [G, R, Kg]
        self.rank, self.group_features = grouped.shape[1:]
        self.inexact = 0
        self.scale_b: torch.Tensor | None = None  # w_scale in cuBLASLt's layout, made on first use per device
        if precision == "fp8":
            q, scale, self.inexact = quantize_padded(grouped)
            self.register_buffer("w", q)  # e4m3 [G, R', Kg']
            self.register_buffer("w_scale", scale)  # fp32 [G, R'/128, Kg'/128]
        else:
            self.register_buffer("w", grouped.clone())  # fp32 [G, R, Kg]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-2]
        if self.precision == "fp32":
            return torch.einsum("...gi,gri->...gr", x.float(), self.w).flatten(-2).to(x.dtype)
        g, k_pad = self.num_groups, self.w.shape[-1]
        xg = pad_last(x.reshape(-1, g, self.group_features), k_pad)  # [T, G, Kg']
        num_tokens = xg.shape[0]
        if num_tokens == 0:
            return x.new_zeros(*lead, g * self.rank)
        # Quantisation is per row of 128 channels, so the rows' order does not change a row's values: quantise
        # the [T·G, Kg'] rows in place (or, at decode, in the GEMM's loop) and let the GEMM gather group g's
        # rows (j·G + g).
        a = activations(self.kernels, xg.reshape(num_tokens * g, k_pad), num_tokens)
        out_dtype = torch.float32 if x.dtype == torch.float32 else torch.bfloat16
        if takes_block_scaled(self.kernels, num_tokens, block_scaled_gemm.GROUPED_MIN_TOKENS, x, out_dtype):
            y = self._block_scaled(a, num_tokens, out_dtype)  # [T, G, R']
            return y[:, :, : self.rank].reshape(*lead, g * self.rank).to(x.dtype)
        # The GEMM writes group g's row t at [t, g] of a [T, G, R'] buffer (through its [G, T, R'] view), so the
        # [T, G·R] result is a view where R' = R: no transposing copy after it.
        out = torch.empty(num_tokens, g, self.w.shape[1], dtype=out_dtype, device=x.device).transpose(0, 1)
        y = self.kernels.moe_grouped_gemm.moe_grouped_gemm(
            a,
            self.w,
            self.w_scale,
            group_rows_meta(num_tokens, g, x.device),
            gather=True,
            out_dtype=out_dtype,
            block_m=linear_block_m(num_tokens),
            out=out,
        )  # [G, T, R']
        return y.transpose(0, 1)[:, :, : self.rank].reshape(*lead, g * self.rank).to(x.dtype)

    def _block_scaled(
        self, a: tuple[torch.Tensor, torch.Tensor], num_tokens: int, out_dtype: torch.dtype
    ) -> torch.Tensor:
        """The [T·G, Kg'] rows' (e4m3, scales) → [T, G, R'] through one block-scaled GEMM a group. cuBLASLt takes
        a group's rows contiguous and its scales M-major, so both are copied group-major first (the e4m3 at a
        byte a channel: half the bf16 input's bytes)."""
        g, k_pad = self.num_groups, self.w.shape[-1]
        self.scale_b = _scale_b(self.scale_b, self.w_scale)  # [G, K_blocks, R'/128]
        q, s = a
        q = q.view(torch.uint8).view(num_tokens, g, k_pad).transpose(0, 1).contiguous().view(q.dtype)  # [G, T, Kg']
        s = s.view(num_tokens, g, -1).permute(1, 2, 0).contiguous()  # fp32 [G, Kg'/128, T]
        out = torch.empty(num_tokens, g, self.w.shape[1], dtype=out_dtype, device=q.device)
        for group in range(g):
            out[:, group] = block_scaled_gemm.matmul(
                (q[group], s[group].t()), self.w[group], self.scale_b[group], out_dtype
            )
        return out

    def extra_repr(self) -> str:
        return f"groups={self.num_groups}, in={self.group_features}, rank={self.rank}, precision={self.precision}"
