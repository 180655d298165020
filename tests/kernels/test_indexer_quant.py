"""Indexer-query FP4 fake quantisation kernel vs ``model.deepseek_v41.quant.fake_quant_indexer``:
``==`` values and sign bits, interpreted on CPU and compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.quant import fake_quant_indexer


def _queries(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, floor: bool = True) -> torch.Tensor:
    """Queries whose 32-channel blocks span scales 2^-60…2^60 and hit every e2m1 case: multiples of a
    quarter of the scale (every midpoint tie: 0.25, 0.75, …, 5), a normal spread, tiny negatives (→ −0),
    an all-zero block and (``floor``) a block at the 6·2^-126 floor, whose outputs are fp32 subnormals."""
    blocks = torch.randint(-60, 60, (*shape[:-1], shape[-1] // 32, 1), generator=gen).float()
    scale = (2.0**blocks).repeat_interleave(32, -2)[..., 0]
    quarters = torch.randint(-24, 25, shape, generator=gen).float() * 0.25
    spread = torch.randn(shape, generator=gen) * 2
    x = torch.where(torch.rand(shape, generator=gen) < 0.5, quarters, spread) * scale
    flat = x.view(-1, shape[-1])
    flat[0, :32] = 0.0
    if floor:
        flat[0, 32:64] = torch.linspace(-1.0, 1.0, 32) * 6.0 * 2.0**-126  # the floor scale 2^-126
    flat[-1, :32] = torch.linspace(-1.0, 1.0, 32) * 2.0**-20  # tiny around the block's largest: −0 codes
    flat[-1, 5] = 6.0
    return x.to(dtype)


def _same(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """== including the sign of zeros (bit patterns)."""
    view = torch.int16 if y.dtype == torch.bfloat16 else torch.int32
    return y.dtype == ref.dtype and torch.equal(y.view(view), ref.view(view))


@pytest.mark.parametrize(
    ("shape", "dtype"), [((3, 4, 128), torch.float32), ((5, 2, 128), torch.bfloat16), ((7, 96), torch.float32)]
)
def test_fake_quant_indexer_interpreted_equals_torch(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    # Triton's interpreter flushes subnormals to zero when it casts fp32 to bf16 (torch and the GPU keep
    # them), so the floor block's subnormal outputs are checked in fp32 here and in bf16 on the GPU.
    x = _queries(shape, dtype, gen, floor=dtype == torch.float32)
    with interpreter():
        y = load_interpreted("indexer_quant").fake_quant_indexer(x)
    ref = fake_quant_indexer(x)
    assert _same(y, ref)
    assert (ref.view(-1) == 0).any() and torch.signbit(ref[ref == 0]).any()  # −0.0 occurs


def test_fake_quant_indexer_strided_input_and_bad_shape():
    gen = torch.Generator().manual_seed(3)
    base = _queries((4, 256), torch.float32, gen)
    x = base[:, 64:192]  # not contiguous
    module = load_interpreted("indexer_quant")
    with interpreter():
        y = module.fake_quant_indexer(x)
    assert _same(y, fake_quant_indexer(x))
    with pytest.raises(ValueError, match="multiple of 32"):
        module.fake_quant_indexer(x[:, :40])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((1, 64, 128), torch.bfloat16), ((257, 64, 128), torch.bfloat16), ((33, 64, 128), torch.float32)],
)
def test_fake_quant_indexer_gpu_equals_torch(shape, dtype):
    from kernels.indexer_quant import fake_quant_indexer as kernel

    x = _queries(shape, dtype, torch.Generator().manual_seed(shape[0]))
    y = kernel(x.cuda())
    assert _same(y, fake_quant_indexer(x.cuda()))  # the torch form on the GPU
    assert _same(y.cpu(), fake_quant_indexer(x))  # and on the CPU


@pytest.mark.parametrize(
    ("rows", "heads", "dim", "pairs"), [(3, 4, 128, 32), (5, 2, 64, 16), (1, 3, 96, 48), (8, 8, 32, 8), (2, 3, 64, 12)]
)
def test_fake_quant_indexer_with_turns_equals_apply_rope_then_quant(rows, heads, dim, pairs):
    """The RoPE folded in: the bits of ``apply_rope_`` then the quantisation (two launches before), x untouched."""
    from model.deepseek_v41.rope import apply_rope_, rope_turns

    gen = torch.Generator().manual_seed(rows * heads * dim)
    x = _queries((rows, heads, dim), torch.float32, gen, floor=dim >= 64)
    angles = torch.randint(0, 5000, (rows,), generator=gen).float()[:, None] * torch.rand(pairs, generator=gen)
    turns = rope_turns(angles)
    before = x.clone()
    with interpreter():
        y = load_interpreted("indexer_quant").fake_quant_indexer(x, turns)
    assert torch.equal(x, before)
    assert _same(y, fake_quant_indexer(apply_rope_(x.clone(), turns)))


def test_fake_quant_indexer_with_turns_rejects_other_dtypes_and_shapes():
    x = torch.randn(2, 2, 64)
    turns = torch.polar(torch.ones(2, 8), torch.rand(2, 8))
    module = load_interpreted("indexer_quant")
    with interpreter():
        with pytest.raises(ValueError, match="turns"):
            module.fake_quant_indexer(x.bfloat16(), turns)
        with pytest.raises(ValueError, match="turns"):
            module.fake_quant_indexer(x, torch.polar(torch.ones(2, 40), torch.rand(2, 40)))  # 80 > 64 channels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fake_quant_indexer_with_turns_gpu_matches_apply_rope_then_quant():
    """Compiled, at v41's indexer shapes (Hi 64, di 128, P 32): the rotation may round once differently from
    torch's complex multiply (FMA contraction), which can move a value across an FP4 bin edge; the rest ==."""
    from kernels.indexer_quant import fake_quant_indexer as kernel
    from model.deepseek_v41.rope import apply_rope_, rope_turns

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 64, 128, generator=gen).cuda()
    turns = rope_turns((torch.arange(8).float()[:, None] * 97 * torch.rand(32, generator=gen)).cuda())
    y = kernel(x, turns)
    ref = fake_quant_indexer(apply_rope_(x.clone(), turns))
    assert float((y != ref).float().mean()) < 1e-3
