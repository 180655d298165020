"""A MoE layer's experts with the routed ones kept MXFP4, as released (``--expert-format fp4``).

The routed experts are stored as the checkpoint stores them (model/deepseek_v41/quant.py, spec §3.11): e2m1
codes two per byte and one e8m0 scale per row and 32 columns; ``kernels/moe_fp4.py`` dequantises them in
registers, exactly, and multiplies in bf16. The shared expert is stored FP8 with 32×32 scales in the
checkpoint, which e2m1 cannot hold, so it stays on the FP8 grouped GEMM (``kernels/moe_grouped_gemm.py``,
e4m3 at 128×128 block scales as ``KernelMoE``'s FP8 stack) in launches of its own (``split_shared``); both
down products write one [E+1, cap, D'] bf16 stack, and the combine sums it as the FP8 path does (the shared
expert first, then the routed picks in top-k order, in fp32).

Layout on the device (D', I' the hidden and expert widths padded to multiples of 128):

=================  ======  =================  =========================================================
buffer             dtype   shape              what
=================  ======  =================  =========================================================
``w13``            uint8   [E, 2I', D'/2]     gate rows [0, I'), up rows [I', 2I'): codes, 2 per byte
``w13_scale``      uint8   [E, 2I', D'/32]    e8m0 bytes (biased exponents), one per row and 32 columns
``w2``             uint8   [E, D', I'/2]      down: codes
``w2_scale``       uint8   [E, D', I'/32]     down: e8m0 bytes
``shared_w13``     e4m3    [1, 2I', D']       the shared expert, FP8 as ``KernelMoE``'s stack
``shared_w2``      e4m3    [1, D', I']        (fp32 [1, N/128, K/128] scales beside each)
=================  ======  =================  =========================================================

The routed stacks are made from the model's fp32 expert weights (the released values, dequantised) by
``quantize_mxfp4``, and the conversion checks that they dequantise back to the same fp32 bits: weights
that came from MXFP4 always do (the scale chosen from a block's amax puts every value on the e2m1 grid);
any that do not are counted in ``routed_inexact`` (and with the shared expert's FP8 rounding in ``inexact``, as
the FP8 path counts its own). A block of zeros gets scale
byte 127 (its codes are 0 whatever the scale), so every byte is inside the kernel's exact range.
"""

from __future__ import annotations

import torch
from torch import nn

from kernels.fp8_weights import stack_gate_up
from kernels.moe_fp4 import check_scales
from kernels.moe_grouped_gemm import split_shared
from kernels.quant_fp8 import IN_GEMM_MAX_ROWS
from model.deepseek_v41.moe import MoE
from model.deepseek_v41.quant import dequantize_mxfp4, quantize_mxfp4
from services.worker.kernel_model.fp8_linear import pad_last, pad_matrix, quantize_padded

EXPERT_FORMATS = ("fp4", "fp8")
"""How routed experts are kept on the device: as released (MXFP4) or converted to FP8 at 128×128."""

ZERO_BLOCK_SCALE = 127
"""The e8m0 byte a block of zero codes gets (scale 1)."""


def encode_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """fp32 [N, K] (K a multiple of 32) → (uint8 codes [N, K/2], uint8 e8m0 bytes [N, K/32], elements whose
    dequantised value differs from w's)."""
    packed, scale = quantize_mxfp4(w)
    inexact = int((dequantize_mxfp4(packed, scale) != w).sum())
    codes, raw = packed.view(torch.uint8), scale.view(torch.uint8)
    magnitudes = (codes & 0x77).unflatten(-1, (-1, 16)).amax(-1)  # [N, K/32]: 0 where every code is ±0
    return codes, torch.where(magnitudes == 0, torch.full_like(raw, ZERO_BLOCK_SCALE), raw), inexact


class Fp4Experts(nn.Module):
    """The experts of one ``MoE`` (routed MXFP4, shared FP8; module docstring), run on ``KernelMoE``'s layout."""

    def __init__(self, moe: MoE, kernels) -> None:
        super().__init__()
        self.kernels = kernels
        self.num_experts, self.intermediate, self.hidden = moe.w1.shape
        self.limit = moe.limit
        self.routed_inexact = 0  # routed expert values MXFP4 does not hold (0 for released weights)
        first13, first2 = self._routed(moe, 0)
        w13 = torch.empty((self.num_experts, *first13[0].shape), dtype=torch.uint8, device=first13[0].device)
        s13 = torch.empty((self.num_experts, *first13[1].shape), dtype=torch.uint8, device=first13[0].device)
        w2 = torch.empty((self.num_experts, *first2[0].shape), dtype=torch.uint8, device=first13[0].device)
        s2 = torch.empty((self.num_experts, *first2[1].shape), dtype=torch.uint8, device=first13[0].device)
        for e in range(self.num_experts):  # one expert's fp32 copies at a time
            (w13[e], s13[e], bad13), (w2[e], s2[e], bad2) = (first13, first2) if e == 0 else self._routed(moe, e)
            self.routed_inexact += bad13 + bad2
        check_scales(s13)
        check_scales(s2)
        for name, t in (("w13", w13), ("w13_scale", s13), ("w2", w2), ("w2_scale", s2)):
            self.register_buffer(name, t)
        gate_up = stack_gate_up(pad_matrix(moe.shared_w1.detach()), pad_matrix(moe.shared_w3.detach()))
        q13, sc13, bad13 = quantize_padded(gate_up[None])
        q2, sc2, bad2 = quantize_padded(moe.shared_w2.detach().float()[None])
        self.inexact = self.routed_inexact + bad13 + bad2  # and the shared expert's, rounded at 128×128 as FP8's
        for name, t in (("shared_w13", q13), ("shared_w13_scale", sc13), ("shared_w2", q2), ("shared_w2_scale", sc2)):
            self.register_buffer(name, t)

    @staticmethod
    def _routed(moe: MoE, e: int):
        gate_up = stack_gate_up(pad_matrix(moe.w1.detach()[e]), pad_matrix(moe.w3.detach()[e]))
        return encode_mxfp4(gate_up), encode_mxfp4(pad_matrix(moe.w2.detach()[e]))

    @property
    def padded_hidden(self) -> int:
        return self.shared_w13.shape[-1]

    def forward(
        self, x: torch.Tensor, meta: dict[str, torch.Tensor], live: torch.Tensor | None, width: int
    ) -> torch.Tensor:
        """x [T, D] → fp32 [T, width]: every stacked expert of ``meta`` (``KernelMoE``'s layout, the shared
        expert last), summed by the combine; rows outside ``live`` [T] (None: all) come out +0.0."""
        y = self.stacked(x, meta)
        return self.kernels.moe_grouped_gemm.moe_combine(y, meta["slot_of"], True, live=live, width=width)

    def keep(self, experts: torch.Tensor) -> None:
        """Keeps only the routed ``experts`` (ids, in the new stack's order; the shared expert stays): an
        expert-parallel rank's slots (services/worker/parallel/ep_kernel_moe.py)."""
        for name in ("w13", "w13_scale", "w2", "w2_scale"):
            setattr(self, name, getattr(self, name).index_select(0, experts.to(self.w13.device)).contiguous())
        self.num_experts = int(experts.numel())

    def stacked(
        self,
        x: torch.Tensor,
        meta: dict[str, torch.Tensor],
        shared_x: torch.Tensor | None = None,
        shared_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [T, D] → the down products of every (stacked expert, slot) of ``meta``: bf16 [E+1, cap, D'] (slots
        past an expert's count unwritten), what the combine sums. The expert-parallel layer's own tokens apart
        from the rows it received: ``shared_x`` [T', D] (None: x), the rows the shared expert's row ids name;
        ``shared_out`` bf16 [1, cap, D'] with dense channels (None: the stack's last expert), where its down
        products go (the stack's last expert is then left unwritten)."""
        gemm, fp4 = self.kernels.moe_grouped_gemm, self.kernels.moe_fp4
        xp = pad_last(x, self.padded_hidden).contiguous()  # [T, D']
        shared_xp = xp if shared_x is None else pad_last(shared_x, self.padded_hidden).contiguous()
        routed, shared = split_shared(meta)
        capacity = meta["row_ids"].shape[1]
        interpreted = self.kernels.interpreted
        h = torch.empty(self.num_experts, capacity, self.w2.shape[-1] * 2, dtype=torch.bfloat16, device=x.device)
        fp4.moe_grouped_gemm_fp4(
            xp, self.w13, self.w13_scale, routed, gather=True, swiglu_limit=self.limit, out=h, dot_fp32=interpreted
        )
        y = torch.empty(self.num_experts + 1, capacity, self.padded_hidden, dtype=torch.bfloat16, device=x.device)
        fp4.moe_grouped_gemm_fp4(h, self.w2, self.w2_scale, routed, gather=False, out=y[:-1], dot_fp32=interpreted)
        # The shared expert: one expert, every live row, FP8 (as moe_grouped_gemm.moe_experts' shared launches).
        a = self.kernels.quant_fp8.quantize_act(shared_xp) if shared_xp.shape[0] > IN_GEMM_MAX_ROWS else shared_xp
        h_shared = gemm.moe_grouped_gemm(
            a,
            self.shared_w13,
            self.shared_w13_scale,
            shared,
            gather=True,
            swiglu_limit=self.limit,
            out_dtype=torch.float8_e4m3fn,
        )
        out = y[-1:] if shared_out is None else shared_out
        gemm.moe_grouped_gemm(h_shared, self.shared_w2, self.shared_w2_scale, shared, gather=False, out=out)
        return y
