"""Indexer-query FP4 fake quantisation kernel vs ``model.deepseek_v41.quant.fake_quant_indexer``:
``==`` values and sign bits, interpreted on CPU and compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from model.deepseek_v41.quant import fake_quant_indexer
from tests.kernels.interpret import interpreter, load_interpreted


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


@pytest.mark.parametrize(("shape", "dtype"),
                         [((3, 4, 128), torch.float32), ((5, 2, 128), torch.bfloat16), ((7, 96), torch.float32)])
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
@pytest.mark.parametrize(("shape", "dtype"), [((1, 64, 128), torch.bfloat16), ((257, 64, 128), torch.bfloat16),
                                              ((33, 64, 128), torch.float32)])
def test_fake_quant_indexer_gpu_equals_torch(shape, dtype):
    from kernels.indexer_quant import fake_quant_indexer as kernel

    x = _queries(shape, dtype, torch.Generator().manual_seed(shape[0]))
    y = kernel(x.cuda())
    assert _same(y, fake_quant_indexer(x.cuda()))  # the torch form on the GPU
    assert _same(y.cpu(), fake_quant_indexer(x))  # and on the CPU
