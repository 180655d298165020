"""Window-K write kernel vs ``CacheEngine.write_window``'s torch form (``quantize_fp8_cache`` bytes
scattered into the ring): ``==`` bytes, interpreted on CPU and compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.quant import quantize_fp8_cache

NUM_SLOTS, RING = 4, 7


def _window_k(num_rows: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """K rows whose 32-channel blocks span scales 2^-40…2^40 and hit every rounding case: 4 mantissa bits
    (half the values are e4m3 ties), e4m3 subnormals, tiny negatives (→ −0), an all-zero block (the 1e-4
    floor), a block whose amax is 448·2^k exactly and one just above."""
    bits = torch.randint(0x3F000000, 0x40800000, (num_rows, head_dim), generator=gen, dtype=torch.int32)
    x = (bits & ~0x7FFFF).view(torch.float32) * torch.where(torch.rand(num_rows, head_dim, generator=gen) < 0.5, -1, 1)
    exponents = torch.randint(-40, 40, (num_rows, head_dim // 32), generator=gen).float()
    x = x * 2.0 ** exponents.repeat_interleave(32, 1)  # one scale per 32-channel block
    x[0, :32] = 0.0
    x[0, 32:64] = torch.linspace(-(2.0**-28), 2.0**-28, 32)  # the 1e-4 floor scale: e4m3 subnormals and −0
    x[min(1, num_rows - 1), :32] = torch.linspace(-(2.0**-14), 2.0**-14, 32)  # amax < 1e-4: the floor scale
    x[-1, :32] = torch.linspace(-448.0, 448.0, 32) * 2.0**5  # amax = 448·2^5
    x[-1, 32:64] = torch.linspace(-1.0, 1.0, 32) * 448.0 * (1 + 2.0**-23) * 2.0**-7  # just above 448·2^-7
    return x.to(dtype)


def _reference(ring: torch.Tensor, slots: torch.Tensor, ring_slots: torch.Tensor, k: torch.Tensor) -> None:
    q, scale = quantize_fp8_cache(k)  # CacheEngine.write_window
    ring[slots, ring_slots] = torch.cat((q.view(torch.uint8), scale.view(torch.uint8)), dim=-1)


def _rings(head_dim: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Two copies of a ring view inside a byte pool with other bytes around it (as ``CacheEngine.ring``)."""
    width = head_dim + head_dim // 32
    pools = [torch.full((NUM_SLOTS, 3 + RING * width + 5), 0xA5, dtype=torch.uint8, device=device) for _ in range(2)]
    return pools[0], pools[1], [p[:, 3 : 3 + RING * width].view(NUM_SLOTS, RING, width) for p in pools]


@pytest.mark.parametrize(
    ("num_rows", "head_dim", "dtype"), [(5, 512, torch.float32), (6, 64, torch.bfloat16), (3, 96, torch.float32)]
)
def test_write_window_interpreted_equals_torch(num_rows, head_dim, dtype):
    gen = torch.Generator().manual_seed(num_rows * head_dim)
    k = _window_k(num_rows, head_dim, dtype, gen)
    slots = torch.randperm(NUM_SLOTS * RING, generator=gen)[:num_rows]  # distinct (slot, ring slot) pairs
    slots, ring_slots = slots // RING, slots % RING
    ring_slots[0] = RING - 1  # the ring's last entry (positions wrap to 0 after it)
    pool, ref_pool, (ring, ref_ring) = _rings(head_dim)
    with interpreter():
        load_interpreted("window_write").write_window(ring, slots, ring_slots, k)
    _reference(ref_ring, slots, ring_slots, k)
    assert torch.equal(pool, ref_pool)  # the written entries and every byte around them
    assert not torch.equal(pool, torch.full_like(pool, 0xA5))


def test_write_window_strided_rows_and_bad_shapes():
    gen = torch.Generator().manual_seed(7)
    base = _window_k(4, 128, torch.float32, gen)
    k = base[::2, :64]  # rows 256 floats apart
    slots, ring_slots = torch.tensor([1, 3]), torch.tensor([0, 6])
    pool, ref_pool, (ring, ref_ring) = _rings(64)
    module = load_interpreted("window_write")
    with interpreter():
        module.write_window(ring, slots, ring_slots, k)
    _reference(ref_ring, slots, ring_slots, k)
    assert torch.equal(pool, ref_pool)
    with pytest.raises(ValueError, match="multiple of 32"):
        module.write_window(ring, slots, ring_slots, k[:, :48])
    with pytest.raises(ValueError, match="ring must be"):
        module.write_window(ring[..., :-1], slots, ring_slots, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("num_rows", "dtype"), [(1, torch.bfloat16), (64, torch.bfloat16), (37, torch.float32)])
def test_write_window_gpu_equals_torch(num_rows, dtype):
    from kernels.window_write import write_window

    gen = torch.Generator().manual_seed(num_rows)
    k = _window_k(num_rows, 512, dtype, gen)
    pairs = torch.randperm(NUM_SLOTS * RING, generator=gen)[: min(num_rows, NUM_SLOTS * RING)]
    k = k[: len(pairs)]
    slots, ring_slots = (pairs // RING).cuda(), (pairs % RING).cuda()
    pool, ref_pool, (ring, ref_ring) = _rings(512, "cuda")
    write_window(ring, slots, ring_slots, k.cuda())
    _reference(ref_ring, slots, ring_slots, k.cuda())  # the torch form on the GPU
    assert torch.equal(pool, ref_pool)
    cpu_pool, _, (cpu_ring, _) = _rings(512)
    _reference(cpu_ring, slots.cpu(), ring_slots.cpu(), k)  # and on the CPU
    assert torch.equal(pool.cpu(), cpu_pool)
