"""Fused compressor kernel vs ``TorchAttention.write_groups`` (the engine's own path): the pool bytes it writes
(compressed-KV entries, index keys) and the fp32 partial rows, interpreted on CPU at the tiny shapes
for ratio 2 (layer 2) and ratio 1 (layer 5), over steps whose ratio-2 groups straddle the steps; and
compiled on a GPU at the Flash shapes (head_dim 512, index_head_dim 128, rope 64), fp32 and bf16.

Byte agreement is exact except where fp32 noise (exp, sum order, the wk product, cos/sin) moves a
value across an FP4 bin edge: every differing code must sit within ``EDGE`` (relative to its block
scale; in bf16, where the noise can flip an intermediate's rounding, two bf16 ulps) of an edge of the
reference's pre-rounding value, scale bytes must agree, and there may be at most one such flip per
10^4 codes (``MAX_FLIP_RATE``). The interpreted tests see none.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.compressor import Compressor
from model.deepseek_v41.indexer import Indexer
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.quant import COMPRESSED_KV_BLOCK, INDEXER_BLOCK, quantize_fp4_cache, unpack_fp4
from model.deepseek_v41.rope import rope_frequencies
from services.worker.attention.backend import StepRounding
from services.worker.attention.torch_backend import TorchAttention
from services.worker.batch.step_batch import StepBatch
from services.worker.state.cache_engine import CacheEngine, ring_size
from tests.model.deepseek_v41.quant_boundary import fp4_boundary_distance

BLOCK_SIZE = 16
MAX_FLIP_RATE = 1e-4
# A flipped code's reference value lies this close to a bin edge, in units of its block scale: fp32
# noise, or in bf16 up to two bf16 ulps of a value ≤ 6 scales (an intermediate rounded the other way).
EDGE = {torch.float32: 1e-5, torch.bfloat16: 6 * 2.0**-7}


def make_layer(cfg, layer: int, gen: torch.Generator, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The parts of ``Attention`` that ``_compress`` uses, with random norm weights (not all ones)."""
    ratio = cfg.ratio(layer)
    comp, idx = Compressor(cfg, ratio), Indexer(cfg, owns_keys=True)
    with torch.no_grad():
        for m in (comp.wkv, comp.wgate, idx.wk):
            if m is not None:
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) / m.weight.shape[1] ** 0.5)
        comp.norm.weight.copy_(1 + 0.2 * torch.randn(cfg.head_dim, generator=gen))
        idx.k_norm.weight.copy_(1 + 0.2 * torch.randn(cfg.index_head_dim, generator=gen))
    idx.to(device=device, dtype=dtype)  # wk and k_norm in the model dtype, as a bf16 model holds them
    return SimpleNamespace(
        layer=layer,
        ratio=ratio,
        compressor=comp.to(device),
        indexer=idx,
        freqs=rope_frequencies(cfg, compressed=True).to(device),
    )


def make_batch(
    requests: list[tuple[int, int]], slots: torch.Tensor, tables: torch.Tensor, ratio: int, epb: int, ring: int
) -> StepBatch:
    """requests: (first position, rows this step) per request; one StepBatch with entry_writes[ratio]."""
    device = tables.device
    first = torch.tensor([f for f, _ in requests], device=device)
    counts = torch.tensor([n for _, n in requests], device=device)
    positions = torch.cat([torch.arange(f, f + n) for f, n in requests]).to(device)
    row_requests = torch.repeat_interleave(torch.arange(len(requests), device=device), counts)
    query_start = torch.cat((torch.zeros(1, dtype=torch.long, device=device), counts.cumsum(0)))
    rows = ((positions + 1) % ratio == 0).nonzero().flatten()
    entry = positions[rows] // ratio
    entry_slots = tables[row_requests[rows], entry // epb] * epb + entry % epb
    n = len(requests)
    return StepBatch(
        request_ids=[f"r{i}" for i in range(n)],
        input_ids=torch.zeros_like(positions),
        positions=positions,
        row_requests=row_requests,
        ring_slots=positions % ring,
        query_start=query_start,
        first=first,
        seqlens_k=first + counts,
        state_slots=slots[:n],
        block_tables=tables[:n],
        sample_rows=query_start[1:] - 1,
        entry_writes={ratio: (rows, entry_slots)},
    )


def flips(
    ours: torch.Tensor, ref: torch.Tensor, pre: torch.Tensor, block: int, fmt: str, edge: float = EDGE[torch.float32]
) -> tuple[int, int]:
    """(differing FP4 codes, all codes) between two pools' entries [E, bytes]; raises unless every
    difference is a bin-edge flip of the reference's pre-rounding values ``pre`` [E, C]."""
    half = pre.shape[-1] // 2
    assert torch.equal(ours[:, half:], ref[:, half:]), "scale bytes differ"
    differ = unpack_fp4(ours[:, :half]) != unpack_fp4(ref[:, :half])  # [E, C]
    if differ.any():
        _, scale = quantize_fp4_cache(pre, block, fmt)
        per_channel = scale.float().repeat_interleave(block, -1)[:, : pre.shape[-1]]
        distance = fp4_boundary_distance(pre, block, fmt) / per_channel
        assert float(distance[differ].max()) <= edge, f"a code differs away from a bin edge: {distance[differ]}"
    return int(differ.sum()), differ.numel()


def run_both(
    cfg,
    layer,
    steps,
    x_scale: float = 1.0,
    seed: int = 0,
    device: str = "cpu",
    interpreted: bool = True,
    dtype: torch.dtype = torch.float32,
    num_slots: int = 8,
    max_position: int = 64,
):
    """Run ``steps`` (lists of (first, rows) per request, requests i in slot i + 1) through the
    reference on one cache and the kernel on a copy; return both caches and the flip counts."""
    gen = torch.Generator().manual_seed(seed)
    attn = make_layer(cfg, layer, gen, dtype, device)
    ring = ring_size(cfg)
    width = max_position // BLOCK_SIZE + 1  # blocks per request
    num_blocks = (num_slots - 1) * width + 1
    ref_cache = CacheEngine(cfg, BLOCK_SIZE, num_blocks=num_blocks, num_state_slots=num_slots, ring=ring, device=device)
    ref_cache.slots.copy_(torch.randint(0, 256, ref_cache.slots.shape, generator=gen).to(torch.uint8))
    partial = ref_cache.partial(layer) if attn.ratio == 2 else None
    if partial is not None:  # plausible fp32 rows, not random bytes (NaNs)
        partial.copy_(torch.randn(partial.shape, generator=gen) * x_scale)
    ours_cache = copy.deepcopy(ref_cache)
    epb = ref_cache.layout.source(layer).entries_per_block
    slots = torch.arange(1, num_slots, device=device)
    tables = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(device).view(num_slots - 1, width)
    module = load_interpreted("compressor") if interpreted else __import__("kernels.compressor").compressor
    counted = {"kv": [0, 0], "keys": [0, 0]}
    for requests in steps:
        batch = make_batch(requests, slots, tables, attn.ratio, epb, ring)
        x = (torch.randn(batch.num_rows, cfg.hidden_size, generator=gen) * x_scale).to(device=device, dtype=dtype)
        pre = {}

        def capture(kind, _layer, values, _requests, _index):
            pre[kind] = values.float()
            return values

        with torch.no_grad():
            TorchAttention(ref_cache, batch, StepRounding(capture, batch.request_ids)).write_groups(attn, x)
            if interpreted:
                with interpreter():
                    module.compress_layer(ours_cache, batch, attn, x)
            else:
                module.compress_layer(ours_cache, batch, attn, x)
        rows, entry_slots = batch.entry_writes[attn.ratio]
        block, offset = entry_slots // epb, entry_slots % epb
        for name, pool, fmt, blk, kind in (
            ("kv", 0, "e4m3", COMPRESSED_KV_BLOCK, "kv4"),
            ("keys", 1, "e8m0", INDEXER_BLOCK, "idx4k"),
        ):
            ours = ours_cache.entries(layer)[pool][block, offset]
            ref = ref_cache.entries(layer)[pool][block, offset]
            n, total = flips(ours, ref, pre[kind], blk, fmt, EDGE[dtype])
            counted[name][0] += n
            counted[name][1] += total
    return ref_cache, ours_cache, counted


def _check(ref_cache, ours_cache, counted):
    assert torch.equal(ours_cache.slots, ref_cache.slots), "state slots (partial rows) differ"
    for name, (n, total) in counted.items():
        assert n <= MAX_FLIP_RATE * total, f"{name}: {n} of {total} codes flipped"
    # Outside the flipped codes the block pools are identical (no stray writes).
    differ = (ours_cache.blocks != ref_cache.blocks).sum()
    assert int(differ) <= counted["kv"][0] + counted["keys"][0]


# Steps of (first position, rows) per request. Ratio 2: odd firsts straddle (member first−1 from the
# partial rows); request 1's 9- and 15-row chunks overwrite the straddling group's partial row in the
# same step (the deferred write); request 4 has no complete group in its first step.
RATIO2_STEPS = [
    [(0, 5), (0, 3), (0, 1), (0, 6), (0, 1)],
    [(5, 1), (3, 9), (1, 2), (6, 1), (1, 15)],
    [(6, 3), (12, 1), (3, 1), (7, 4), (16, 1)],
]


def test_interpreted_ratio2_matches_torch_attention():
    ref, ours, counted = run_both(TINY, 2, RATIO2_STEPS)
    _check(ref, ours, counted)
    assert counted["kv"][1] > 1000 and counted["keys"][1] > 500  # the steps made entries


def test_interpreted_ratio1_matches_torch_attention():
    ref, ours, counted = run_both(TINY, 5, [[(0, 3), (0, 1), (0, 20)], [(3, 1), (1, 4), (20, 1)]], seed=1)
    _check(ref, ours, counted)


def test_interpreted_large_values_and_straddle_only():
    """Decode-like steps (one row per request, every odd position straddles) at large magnitudes."""
    steps = [
        [(p, 1) for p in (1, 3, 7, 9, 11, 13)],
        [(p, 1) for p in (2, 4, 8, 10, 12, 14)],
        [(p, 1) for p in (3, 5, 9, 11, 13, 15)],
    ]
    ref, ours, counted = run_both(TINY, 2, steps, x_scale=40.0, seed=2)
    _check(ref, ours, counted)


# ---------------------------------------------------------------- GPU, Flash shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ratio", [2, 1])
def test_gpu_flash_shapes_match_torch_attention(ratio, dtype):
    from services.bench.kernels.compressor import flash_source_config

    cfg, layer = flash_source_config(ratio), 2  # Flash shapes, one source (3 layers of rings per slot)
    decode = [(2 * i + 1 + (i % 2), 1) for i in range(40)]
    steps = [[(0, 37), (0, 8), (0, 1)] + decode, [(37, 20), (8, 9), (1, 1)] + [(f + 1, 1) for f, _ in decode]]
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference's fp32 wk product in IEEE fp32, as the kernel's
    try:
        ref, ours, counted = run_both(
            cfg, layer, steps, seed=ratio, device="cuda", interpreted=False, dtype=dtype, num_slots=48, max_position=128
        )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    _check(ref, ours, counted)
    print(f"ratio {ratio} {dtype}: flipped codes {counted}")


@pytest.mark.parametrize("ratio", [2, 1])
def test_bench_problem_on_cpu(ratio, one_torch_thread):
    """The benchmark's Flash-shaped decode problem (fp32 here: the interpreter truncates bf16) gives the
    same bytes through the interpreted kernel as through ``TorchAttention.write_groups``."""
    from services.bench.kernels.compressor import compressor_problem, run_kernel, run_torch

    p = compressor_problem(3, ratio, torch.Generator().manual_seed(ratio), device="cpu", dtype=torch.float32)
    run_torch(p)
    with interpreter():
        run_kernel(p, load_interpreted("compressor").compress)
    assert torch.equal(p["cache"].slots, p["ref_cache"].slots)
    assert torch.equal(p["cache"].blocks, p["ref_cache"].blocks)
    assert int((p["cache"].blocks != 0).sum()) > 3 * 300


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ratio", [2, 1])
def test_gpu_graph_replay_matches_torch_attention(ratio):
    """The benchmark's decode problem (E = 300, bf16), the kernel captured in a CUDA graph and replayed:
    the same bytes as ``TorchAttention.write_groups`` up to bin-edge flips (≤ 1 per 10^4 bytes)."""
    from services.bench.kernels.compressor import compressor_problem, run_kernel, run_torch

    p = compressor_problem(300, ratio, torch.Generator("cuda").manual_seed(ratio))
    graph = torch.cuda.CUDAGraph()
    run_kernel(p)  # compile outside the capture
    p["cache"].blocks.zero_()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        run_kernel(p)
    graph.replay()
    run_torch(p)
    assert torch.equal(p["cache"].slots, p["ref_cache"].slots)
    differ = int((p["cache"].blocks != p["ref_cache"].blocks).sum())
    assert differ <= MAX_FLIP_RATE * 300 * 356, f"{differ} bytes differ"
    assert int((p["cache"].blocks != 0).sum()) > 300 * 300
