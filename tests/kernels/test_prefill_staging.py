"""Per-step staging for sparse prefill attention (kernels/prefill_staging.py): the window keys' layout and
values against the torch dequantisation of their sources, and their exactness in bf16. (Staged keys
against the in-loop path, through the attention kernel: tests/kernels/test_prefill_attention.py.)"""

from __future__ import annotations

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.quant import dequantize_fp8_cache, quantize_fp8_cache
from tests.kernels.test_prefill_attention import CHUNKS, MORE_CHUNKS, _staged_window, _tiny


def test_e4m3_times_every_cache_scale_is_exact_in_bf16():
    """Every finite e4m3 code × every e8m0 scale the window cache can hold (from the quantiser's
    smallest, that of an all-zero group, up) is a bf16 value: ≤ 4 significant bits shifted."""
    smallest = int(quantize_fp8_cache(torch.zeros(1, 32))[1].view(torch.uint8))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[codes.isfinite()]  # the two NaN codes never occur in the caches
    scales = torch.arange(smallest, 255, dtype=torch.int32).to(torch.uint8).view(torch.float8_e8m0fnu).float()
    values = codes[:, None] * scales[None, :]  # exact in fp32: fp32's exponent range holds every finite one
    finite = values.isfinite()
    # The range checked: scales 2^−20 or smaller up to 2^118 (448 · 2^118 < 2^128) all finite.
    assert smallest - 127 <= -20 and bool(finite[:, : 127 + 118 - smallest + 1].all())
    assert torch.equal(values.to(torch.bfloat16).float()[finite], values[finite])


@pytest.mark.parametrize(("window", "chunks"), [(8, CHUNKS), (20, MORE_CHUNKS), (1, MORE_CHUNKS)])
def test_window_rows_hold_each_rows_window_in_order(window, chunks):
    """Row r's window position pos − w + 1 + j is staged row rows[r] − w + 1 + j: the ring's key before its
    request's first row, this step's K row from it on, zeros below position 0; in fp32 and, exactly, in
    bf16. Window 1: no ring rows at all."""
    cfg, prob = _tiny(window, window, chunks)
    module = load_interpreted("prefill_staging")
    step_k = quantize_fp8_cache(prob["k"])
    with interpreter():
        keys, rows = _staged_window(module, cfg, prob, step_k)
        keys_bf16, rows_bf16 = _staged_window(module, cfg, prob, step_k, torch.bfloat16)
    ring, slots, pos, reqs = prob["ring"], prob["slots"], prob["pos"], prob["row_requests"]
    num_rows, dim = len(pos), cfg.head_dim
    step_keys = dequantize_fp8_cache(*step_k)
    ring_keys = dequantize_fp8_cache(ring[..., :dim], ring[..., dim:])  # [slots, ring, D]
    assert torch.equal(rows, torch.arange(num_rows, dtype=torch.int32) + (window - 1) * (reqs.int() + 1))
    for r in range(num_rows):
        first, slot = int(prob["first"][reqs[r]]), int(slots[reqs[r]])
        for j in range(window):
            p = int(pos[r]) - window + 1 + j
            want = (
                torch.zeros(dim)
                if p < 0
                else ring_keys[slot, p % ring.shape[1]]
                if p < first
                else step_keys[r - int(pos[r]) + p]
            )
            assert torch.equal(keys[int(rows[r]) - window + 1 + j], want), (r, j, p)
    assert torch.equal(rows_bf16, rows) and torch.equal(keys_bf16.float(), keys)
