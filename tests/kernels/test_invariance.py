"""The GPU form of the batch-invariant mode (kernels/invariance.py): fixed launch choices and row tiles.

CPU: the launch choices under the mode at very different batch sizes, ``by_rows``, and the whole kernel
engine (FP8, every kernel interpreted) giving ``==`` logits for requests alone and in a chunked batch.
CUDA: the compiled kernels' decode rows through decode and prefill attention, and the head.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kernels import invariance
from services.worker.kernel_model.fp8_linear import linear_block_m
from services.worker.runners.model_runner import ModelRunner


def cuda(test):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(test))


def test_launch_choices_do_not_follow_the_batch_in_the_mode():
    from kernels import mhc

    outside = {linear_block_m(1), linear_block_m(4096)}
    mix_outside = {mhc._mix_config(t, 4096, None, None) for t in (1, 64, 4096)}
    with invariance.fixed_configs():
        assert {linear_block_m(t) for t in (1, 17, 256, 4096)} == {invariance.BLOCK_M}
        assert len({mhc._mix_config(t, 4096, None, None) for t in (1, 64, 4096)}) == 1
    assert len(outside) == 2 and len(mix_outside) > 1  # the mode is what fixes them
    assert not invariance.active()


def test_by_rows_runs_fixed_tiles_only_in_the_mode():
    shapes: list[tuple[int, ...]] = []

    def double(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shapes.append(tuple(x.shape))
        return 2 * x, x.sum(-1)

    x = torch.randn(150, 3)
    out = invariance.by_rows(double, x)
    assert shapes == [(150, 3)]
    shapes.clear()
    with invariance.fixed_configs():
        tiled = invariance.by_rows(double, x)
    assert shapes == [(invariance.ROW_CHUNK, 3)] * 3
    assert torch.equal(tiled[0], out[0]) and tiled[1].shape == (150,)
    with invariance.fixed_configs(False):
        assert not invariance.active()


def _bi_runner(small, budget: int, kernels, batch_invariant: bool) -> ModelRunner:
    from tests.services.worker.kernel_model.test_backend import _config

    config = dataclasses.replace(_config(small, budget), batch_invariant=batch_invariant)
    return ModelRunner(copy.deepcopy(small.model), config, backend="kernels", precision="fp8", kernels=kernels)


def test_interpreted_fp8_engine_gives_equal_logits_alone_and_in_a_chunked_batch(batch_invariant: bool = True):
    """Every kernel of the FP8 engine under Triton's interpreter, in the mode: the three requests
    together at a 10-token budget (chunks [6, 4], [1, 9], [7], then decode: a one-row chunk among
    prefill rows, decode rows in mixed steps) against r1 alone at a budget that takes its prompt
    whole. Each of r1's (position)'s logits must be ``==``."""
    from kernels.interpret import interpreter
    from tests.services.worker.kernel_model.test_backend import Case, drive, interpreted, small_case

    small, kernels = small_case(), interpreted()
    one = Case(small.model, {"r1": small.seqs["r1"]}, None, {}, {})
    with interpreter():
        together = drive(small, _bi_runner(small, 10, kernels, batch_invariant), 10, decode_steps=1)
        alone = drive(one, _bi_runner(one, 64, kernels, batch_invariant), 64, decode_steps=1)
    assert sorted(alone) == sorted(key for key in together if key[0] == "r1") and len(alone) == 6
    unequal = [key for key in alone if not torch.equal(together[key], alone[key])]
    assert not unequal, f"{len(unequal)} of {len(alone)} positions differ, first {unequal[:3]}"


# ---------------------------------------------------------------- CUDA: the compiled kernels


@cuda
def test_decode_row_is_equal_through_decode_and_prefill_attention():
    """In the mode a decode row gives the same bits through the decode kernel (its K already in the
    ring) and the prefill kernel (its K as this step's row), at Flash's head shapes."""
    from kernels import decode_attention, prefill_attention
    from model.deepseek_v41.quant import quantize_fp8_cache

    torch.manual_seed(0)
    dev, heads, dim, window, ring_size, topk, rows = "cuda", 64, 512, 128, 256, 512, 5
    ring = torch.zeros(rows + 1, ring_size, dim + dim // 32, dtype=torch.uint8, device=dev)
    positions = torch.tensor([3, 40, 127, 128, 600], device=dev)
    slots = torch.arange(1, rows + 1, device=dev)
    for r in range(rows):  # every window position up to and including the row's own
        p = torch.arange(max(0, int(positions[r]) - window + 1), int(positions[r]) + 1, device=dev)
        codes, scales = quantize_fp8_cache(torch.randn(len(p), dim, device=dev))
        ring[int(slots[r]), p % ring_size] = torch.cat((codes.view(torch.uint8), scales.view(torch.uint8)), -1)
    epb, blocks = 16, 64
    pool = torch.randint(0, 255, (blocks, epb, dim // 2 + dim // 16), dtype=torch.uint8, device=dev)
    pool[..., dim // 2 :] = torch.randint(0x30, 0x40, pool[..., dim // 2 :].shape, dtype=torch.uint8, device=dev)
    selected = torch.randint(epb, blocks * epb, (rows, topk), dtype=torch.int32, device=dev)
    selected[0, 100:] = -1
    q = torch.randn(rows, heads, dim, device=dev).to(torch.bfloat16)
    sink, freqs, scale = torch.randn(heads, device=dev), torch.rand(32, device=dev), dim**-0.5
    own = ring[slots.long(), positions % ring_size]  # [R, D + D/32] the rows' own K bytes
    step_k = (own[:, :dim].view(torch.float8_e4m3fn), own[:, dim:].view(torch.float8_e8m0fnu))
    with invariance.fixed_configs():
        dec = [
            decode_attention.sparse_decode_attention(
                q[i : i + 1],
                ring,
                slots[i : i + 1],
                positions[i : i + 1],
                window,
                pool,
                selected[i : i + 1],
                sink,
                freqs,
                scale,
            )
            for i in range(rows)
        ]
        dec_all = decode_attention.sparse_decode_attention(
            q, ring, slots, positions, window, pool, selected, sink, freqs, scale
        )
        pre = prefill_attention.sparse_prefill_attention(
            q, step_k, ring, slots, positions, positions, window, pool, selected, sink, freqs, scale
        )
    assert torch.equal(torch.cat(dec), dec_all)
    assert torch.equal(dec_all, pre)


@cuda
def test_head_rows_are_equal_alone_and_in_any_batch():
    from services.worker.kernel_model.head import KernelHead

    torch.manual_seed(0)
    head = KernelHead(torch.randn(4096, 1024).to(torch.bfloat16).float()).cuda()
    y = torch.randn(200, 1024, device="cuda")
    with invariance.fixed_configs():
        batch = head(y)
        alone = torch.cat([head(y[i : i + 1]) for i in (0, 63, 64, 199)])
    assert torch.equal(batch[[0, 63, 64, 199]], alone)
