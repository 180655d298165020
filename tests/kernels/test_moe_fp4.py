"""MXFP4 grouped GEMM (kernels/moe_fp4.py): interpreted on CPU, its in-register dequantisation against the
checkpoint's decoder bit for bit, and its products against an fp64 reference on the same bf16 inputs; compiled
on a GPU at v41-s1's shapes."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.moe import clamped_swiglu
from model.deepseek_v41.quant import dequantize_mxfp4
from services.worker.kernel_model.fp4_experts import encode_mxfp4
from tests.tolerances import FP32_REORDER_REL


def _stack(num_experts: int, n: int, k: int, gen: torch.Generator, spread: int = 12):
    """MXFP4 stacks (codes, scale bytes) of random weights whose per-32 scales span ``spread`` binades, and
    their exact fp32 values [E, N, K]."""
    w = torch.randn(num_experts, n, k, generator=gen, device=gen.device)
    binades = torch.randint(-spread, 1, (num_experts, n, k // 32), generator=gen, device=gen.device)
    w = w * torch.exp2(binades.float()).repeat_interleave(32, -1)
    w[0, :, :32] = 0.0  # a zero block: scale byte 127
    codes, scales, values = [], [], []
    for e in range(num_experts):
        c, s, _ = encode_mxfp4(w[e])
        codes.append(c)
        scales.append(s)
        values.append(dequantize_mxfp4(c.view(torch.int8), s.view(torch.float8_e8m0fnu)))
    return torch.stack(codes), torch.stack(scales), torch.stack(values)


def _routing(num_tokens: int, num_experts: int, top_k: int, gen: torch.Generator):
    experts = torch.rand(num_tokens, num_experts, generator=gen, device=gen.device).argsort(-1)[:, :top_k]
    weights = torch.rand(num_tokens, top_k, generator=gen, device=gen.device)
    return reference.route_metadata(experts, weights, num_experts)


def _valid(out: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return torch.cat([out[e, : int(counts[e])] for e in range(out.shape[0])])


def test_encode_mxfp4_round_trips_released_values_and_names_zero_blocks():
    gen = torch.Generator().manual_seed(0)
    codes, scales, values = _stack(2, 4, 64, gen)
    assert codes.dtype == scales.dtype == torch.uint8
    assert int(scales[0, 0, 0]) == 127  # the zero block
    for e in range(2):
        again, again_scale, inexact = encode_mxfp4(values[e])  # codes may differ (another scale, -0): values not
        back = dequantize_mxfp4(again.view(torch.int8), again_scale.view(torch.float8_e8m0fnu))
        assert inexact == 0 and torch.equal(back, values[e])
    _, _, inexact = encode_mxfp4(torch.full((1, 32), 0.3))  # 0.3 is not on the e2m1 grid at any scale
    assert inexact > 0


def _identity_meta(k: int, device) -> dict[str, torch.Tensor]:
    """One expert whose k tokens are the rows of the identity: out[n, j] = w[n, j] exactly."""
    experts = torch.zeros(k, 1, dtype=torch.long, device=device)
    return reference.route_metadata(experts, torch.ones(k, 1, device=device), 1)


def _dequantised_by_kernel(fp4, codes, scales, dot_fp32: bool) -> torch.Tensor:
    k = 2 * codes.shape[-1]
    eye = torch.eye(k, device=codes.device)
    meta = _identity_meta(k, codes.device)
    out = fp4.moe_grouped_gemm_fp4(eye, codes[:1], scales[:1], meta, gather=True, dot_fp32=dot_fp32)
    return out[0, :k].float().T  # [N, K]


def test_dequantisation_in_registers_is_bit_exact_interpreted():
    gen = torch.Generator().manual_seed(1)
    codes, scales, values = _stack(1, 128, 128, gen, spread=30)
    fp4 = load_interpreted("moe_fp4")
    with interpreter():
        got = _dequantised_by_kernel(fp4, codes, scales, dot_fp32=True)
    assert torch.equal(got, values[0])


@pytest.mark.parametrize(("num_tokens", "swiglu"), [(3, True), (40, True), (40, False)])
def test_products_interpreted_match_fp64_on_the_same_bf16_inputs(num_tokens, swiglu):
    gen = torch.Generator().manual_seed(num_tokens)
    num_experts, hidden, inter = 4, 256, 128
    meta = _routing(num_tokens, num_experts, 2, gen)
    n_w = 2 * inter if swiglu else inter
    codes, scales, values = _stack(num_experts, n_w, hidden, gen)
    x = torch.randn(num_tokens, hidden, generator=gen).to(torch.bfloat16).float()  # the interpreter's cast truncates
    fp4 = load_interpreted("moe_fp4")
    with interpreter():
        out = fp4.moe_grouped_gemm_fp4(
            x,
            codes,
            scales,
            meta,
            gather=True,
            swiglu_limit=0.5 if swiglu else None,
            out_dtype=torch.float32,
            dot_fp32=True,
        )
    a = x.to(torch.bfloat16).double()[meta["row_ids"].long()]  # [E, cap, K]
    ref = torch.bmm(a, values.double().transpose(1, 2))
    if swiglu:
        ref = clamped_swiglu(ref[..., :inter], ref[..., inter:], 0.5) * meta["route_w"].double()[..., None]
    got, want = _valid(out, meta["counts"]).double(), _valid(ref, meta["counts"])
    assert float((got - want).norm() / want.norm()) < FP32_REORDER_REL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dequantisation_and_products_on_the_gpu_at_v41_shapes():
    device = torch.device("cuda")
    gen = torch.Generator(device).manual_seed(2)
    from kernels import moe_fp4

    codes, scales, values = _stack(1, 256, 512, gen, spread=30)
    assert torch.equal(_dequantised_by_kernel(moe_fp4, codes, scales, dot_fp32=False), values[0])
    num_experts, hidden, inter = 8, 5120, 2304
    for num_tokens in (1, 64, 256):
        meta = _routing(num_tokens, num_experts, 6, gen)
        codes, scales, values = _stack(num_experts, 2 * inter, hidden, gen)
        x = torch.randn(num_tokens, hidden, generator=gen, device=device)
        out = moe_fp4.moe_grouped_gemm_fp4(
            x, codes, scales, meta, gather=True, swiglu_limit=7.0, out_dtype=torch.float32
        )
        a = x.to(torch.bfloat16).double()[meta["row_ids"].long()]
        ref = torch.bmm(a, values.double().transpose(1, 2))
        ref = clamped_swiglu(ref[..., :inter], ref[..., inter:], 7.0) * meta["route_w"].double()[..., None]
        got, want = _valid(out, meta["counts"]).double(), _valid(ref, meta["counts"])
        assert float((got - want).norm() / want.norm()) < FP32_REORDER_REL
