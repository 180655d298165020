"""Prefill's dense FP8 products through cuBLASLt's block-scaled GEMM (``torch.nn.functional.scaled_mm``).

The operands are the Triton one-expert GEMM's (services/worker/kernel_model/fp8_linear.py): e4m3 activations with one
power-of-two scale per token and 128 channels (``kernels.quant_fp8.quantize_act``), and the e4m3 weight
with one power-of-two scale per 128×128 block. Both GEMMs scale each 128-deep partial product by
``a_scale · w_scale`` and sum the partials in fp32, so they differ only in summation order and in where
the output is rounded from. What this one brings: Hopper GEMM tiles with TMA and warp
specialisation, faster than the Triton GEMM at prefill's sizes (``shinkai bench kernels --only prefill_gemms``
measures both side by side; docs/performance.md, "Kernels").

Layouts cuBLASLt takes on sm_90 (an error message names the expected shape or strides):
- ``mat_a``: e4m3 [M, K], row-major; ``scale_a``: fp32 [M, K/128], M-major (strides (1, M));
- ``mat_b``: the weight [N, K] passed as ``w.t()`` ([K, N], column-major);
- ``scale_b``: fp32 [K_blocks, N/128] with strides (1, K_blocks), K_blocks = K/128 rounded up to a
  multiple of 4 (the rows past K/128 hold 1.0 and meet no data);
- the output is bf16 or fp32 (``out_dtype``; each probed on its own).

It is used outside the batch-invariant mode (where the kernel must not depend on the batch), for bf16 or
fp32 activations (the output takes their dtype) with at least ``LINEAR_MIN_TOKENS`` (projections),
``GROUPED_MIN_TOKENS`` (attention's grouped wo_a) or ``MIN_TOKENS`` (experts) rows, on a device where
``available(device, dtype)`` holds: compute capability 9.x, a torch with the block-wise recipes, and a first
product on that device that agrees with the dequantised fp32 product.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from kernels.reference import GROUP, dequantize_weight_block128

log = logging.getLogger(__name__)

MIN_TOKENS = 1024
"""Rows from which prefill takes this GEMM: the smallest M of the prefill GEMM measurements (1,024 × 32,768 ×
1,280, where it already beat the Triton GEMM): the experts' threshold (block_scaled_experts.py); the dense
projections take it from ``LINEAR_MIN_TOKENS``."""

LINEAR_MIN_TOKENS = 64
"""Rows from which ``KernelLinear`` (the dense projections) takes this GEMM, decode's graph-captured steps
included. Chosen from v41-s1's projections, eager with the L2 flushed (``kernels_prefill_gemms.bench_projections``),
against the Triton one-expert GEMM at decode's tile (BLOCK_M 16, which re-reads the weights once per 16 rows):
faster at 256 rows on every projection and at 64 rows summed over the five per layer (docs/performance.md,
"Kernels"). Below 64 rows not measured: split-K and the in-GEMM quantisation keep those. The experts keep
``MIN_TOKENS``, attention's grouped wo_a ``GROUPED_MIN_TOKENS``."""

GROUPED_MIN_TOKENS = 4096
"""Tokens from which ``GroupedKernelLinear`` (attention's wo_a: G groups of Kg → R, one GEMM a group) takes this
GEMM. Chosen from v41-s1's wo_a (8 groups of 4,096 → 1,024), the whole module eager
(``kernels_prefill_gemms.bench_wo_a``): cuBLASLt's cost is nearly flat up to 4K tokens (eight calls of N = 1,024
each, and the group-major copies) while the Triton grouped GEMM's grows with the tokens; from 4K cuBLASLt wins.
A threshold of 64 tokens slowed decode at batch 64 (docs/performance.md, "Kernels" and "Decode step")."""

PROBE_REL = 2.0**-7
"""The probe's bound, relative Frobenius error of the output against the fp32 product of the same e4m3
operands and scales: a bf16 output's one round-to-nearest cast is ≤ 2^-9 relative (RMS about 1.7e-3 on
random data); summation order and the tensor cores' accumulation inside a 128-deep block are far below
it (an fp32 output has only those). A wrong scale layout is off by factors of 2 or more."""

OUT_DTYPES = (torch.bfloat16, torch.float32)

_AVAILABLE: dict[tuple[torch.device, torch.dtype], bool] = {}


def scale_b(w_scale: torch.Tensor) -> torch.Tensor:
    """The weight's block scales fp32 [..., N/128, K/128] → cuBLASLt's [..., K_blocks, N/128], each matrix with
    strides (1, K_blocks) (a stack of experts' scales: ``scale_b(s)[e]`` is ``scale_b(s[e])``)."""
    *lead, nb, kb = w_scale.shape
    k_blocks = -(-kb // 4) * 4
    padded = torch.ones(*lead, nb, k_blocks, dtype=torch.float32, device=w_scale.device)
    padded[..., :kb] = w_scale
    return padded.transpose(-1, -2)


ROW_ALIGN = 4
"""``matmul`` hands cuBLASLt a multiple of this many rows: scale_a is M-major, so its columns start every
M floats, and a cuBLAS user reports that cuBLAS wants M a multiple of 4 there (16-byte aligned columns, as
scale_b's K_blocks are padded to 4); the GPU test at M = 1,030 checks the padded call."""


def matmul(
    a: tuple[torch.Tensor, torch.Tensor],
    w: torch.Tensor,
    w_scale_b: torch.Tensor,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(e4m3 [M, K], fp32 [M, K/128]) · (e4m3 [N, K])ᵀ with ``scale_b(w_scale)`` → ``out_dtype`` [M, N].
    M not a multiple of ``ROW_ALIGN`` is padded with zero rows (scale 1), and the output cut back: a copy
    of the activations that callers avoid by passing aligned row counts (block_scaled_experts.py)."""
    q, s = a
    num_rows = q.shape[0]
    pad = -num_rows % ROW_ALIGN
    if pad:
        q = torch.cat((q.view(torch.uint8), q.new_zeros(pad, q.shape[1], dtype=torch.uint8))).view(q.dtype)  # 0: e4m3 0
        s = torch.cat((s, s.new_ones(pad, s.shape[1])))
    recipe_a, recipe_b = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128
    out = F.scaled_mm(q, w.t(), s.t().contiguous().t(), recipe_a, w_scale_b, recipe_b, output_dtype=out_dtype)
    return out[:num_rows] if pad else out


def available(device: torch.device, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether ``matmul`` runs and agrees on ``device`` with ``out_dtype`` output (probed once per device and
    dtype, logged once)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # "cuda" and "cuda:N" name one device: one probe
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, out_dtype)
    if key not in _AVAILABLE:
        _AVAILABLE[key] = out_dtype in OUT_DTYPES and _probe(device, out_dtype)
    return _AVAILABLE[key]


def _probe(device: torch.device, out_dtype: torch.dtype) -> bool:
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False
    if not hasattr(F, "scaled_mm") or not hasattr(F.ScalingType, "BlockWise128x128"):
        log.info("torch %s has no block-wise scaled_mm: prefill's FP8 products stay on Triton", torch.__version__)
        return False
    from kernels.fp8_weights import quantize_weight_block128
    from kernels.quant_fp8 import quantize_act

    gen = torch.Generator(device=device).manual_seed(0)
    m, n, k = 256, 384, 640  # K/128 = 5: the scale_b padding to a multiple of 4 is exercised
    x = torch.randn(m, k, device=device, generator=gen).to(torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=gen) * torch.logspace(
        -3, 3, k // GROUP, base=2.0, device=device
    ).repeat_interleave(GROUP)
    wq, ws = quantize_weight_block128(w)
    a = quantize_act(x)
    exact = (a[0].float() * a[1].repeat_interleave(GROUP, dim=1)) @ dequantize_weight_block128(wq, ws).t()
    try:
        got = matmul(a, wq, scale_b(ws), out_dtype)
    except (RuntimeError, NotImplementedError) as err:
        log.warning(
            "block-scaled scaled_mm with %s output failed on %s (%s): those FP8 products stay on Triton",
            out_dtype,
            device,
            err,
        )
        return False
    rel = float((got.float() - exact).norm() / exact.norm())
    if got.dtype != out_dtype or not rel <= PROBE_REL:
        log.warning(
            "block-scaled scaled_mm with %s output disagrees on %s (%s, relative error %.3g > %.3g): "
            "those FP8 products stay on Triton",
            out_dtype,
            device,
            got.dtype,
            rel,
            PROBE_REL,
        )
        return False
    log.info(
        "prefill's FP8 products with %s output from %d rows: cuBLASLt block-scaled GEMM (probe relative error %.2g)",
        out_dtype,
        MIN_TOKENS,
        rel,
    )
    return True
