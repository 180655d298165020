"""Sparse decode attention vs ``kernels.reference.sparse_decode_attention``: the reference against the
engine's cached attention (``AttentionStep.attend`` on the torch backend) on the tiny model, the kernel interpreted on
CPU at small shapes, and compiled on a GPU at the Flash shapes (64 heads × 512, ring 134, top-k 512)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.rope import rope_frequencies
from services.worker.state.cache_engine import CacheEngine, ring_size
from tests.tolerances import BF16_CAST_REL, BF16_EMULATION_REL, BF16_PATH_REL, FP32_REORDER_REL

BLOCK_SIZE = 16


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _fill_cache(
    cache: CacheEngine,
    cfg,
    layer: int,
    source: int,
    num_rows: int,
    context: int,
    gen: torch.Generator,
    device: str = "cpu",
) -> dict[str, torch.Tensor]:
    """Random rings (every position < context) and entries for ``num_rows`` requests; a decode problem.

    Row r is request r at position pos[r] (some below the window, so part of the window is masked),
    with its own state slot and block table; its selection is ascending distinct visible entries,
    some rows padded with −1.
    """
    ratio = cfg.ratio(layer)
    lay = cache.layout
    epb = lay.source(source).entries_per_block
    hd = cfg.head_dim
    pos = torch.randint(0, context, (num_rows,), generator=gen, device=device)
    pos[0] = 2  # fewer window positions than the window
    pos[-1] = context - 1
    slots = torch.randperm(cache.slots.shape[0] - 1, generator=gen, device=device)[:num_rows] + 1
    width = -(-context // ratio // epb)
    tables = (torch.randperm(cache.blocks.shape[0] - 1, generator=gen, device=device)[: num_rows * width] + 1).view(
        num_rows, width
    )
    for r in range(num_rows):
        p = int(pos[r])
        span = torch.arange(max(0, p - lay.ring_size + 1), p + 1, device=device)
        k = torch.randn(span.numel(), hd, generator=gen, device=device) * 2
        cache.write_window(layer, slots[r].expand(span.numel()), span % lay.ring_size, k)
        visible = (p + 1) // ratio
        entries = torch.arange(visible, device=device)
        kv = torch.randn(visible, hd, generator=gen, device=device)
        keys = torch.randn(visible, cfg.index_head_dim, generator=gen, device=device)
        cache.write_entries(source, tables[r, entries // epb] * epb + entries % epb, kv, keys)
    topk = cfg.index_topk
    sel = torch.full((num_rows, topk), -1, dtype=torch.long, device=device)
    for r in range(num_rows):
        visible = (int(pos[r]) + 1) // ratio
        take = min(visible, topk) if r % 3 else min(visible, topk // 2)
        pick = torch.randperm(visible, generator=gen, device=device)[:take].sort().values
        sel[r, :take] = pick
    return dict(
        pos=pos,
        slots=slots,
        tables=tables,
        selected_entries=sel,
        selected=reference.entry_slots(sel, tables, epb),
        kv_pool=cache.entries(source)[0],
        ring=cache.ring(layer),
    )


# ---------------------------------------------------------------- the reference is the engine's attention


def test_reference_equals_torch_attention():
    """The reference on the packed cache bytes equals ``AttentionStep.attend`` on the torch backend (tiny, ratio-2 layer
    3, which reuses source 2's entries and layer 2's selection), compared before the output projection."""
    from model.deepseek_v41.attention import Attention
    from model.deepseek_v41.rope import apply_rope, rope_angles
    from services.worker.attention.step import AttentionStep
    from services.worker.attention.torch_backend import StepSparse, TorchAttention
    from services.worker.batch.step_batch import StepBatch

    torch.manual_seed(0)
    cfg, layer, source = TINY, 3, 2
    gen = torch.Generator().manual_seed(3)
    ring = ring_size(cfg)
    cache = CacheEngine(cfg, BLOCK_SIZE, num_blocks=64, num_state_slots=8, ring=ring)
    num_rows, context = 5, 40
    prob = _fill_cache(cache, cfg, layer, source, num_rows, context, gen)
    attn = Attention(cfg, layer)
    with torch.no_grad():
        attn.attn_sink.copy_(torch.randn(cfg.num_attention_heads, generator=gen))
    pos = prob["pos"]
    # The positions before each row are cached: the row's own K is written to the ring by attend.
    batch = StepBatch(
        request_ids=[f"r{i}" for i in range(num_rows)],
        input_ids=torch.zeros(num_rows, dtype=torch.long),
        positions=pos,
        row_requests=torch.arange(num_rows),
        ring_slots=pos % ring,
        query_start=torch.arange(num_rows + 1),
        first=pos.clone(),
        seqlens_k=pos + 1,
        state_slots=prob["slots"],
        block_tables=prob["tables"],
        sample_rows=torch.arange(num_rows),
        entry_writes={},
    )
    backend = TorchAttention(cache, batch)
    step = AttentionStep(backend, batch.positions, batch.row_requests)
    width = int(((pos + 1) // cfg.ratio(layer)).max())
    kv, keys = cache.read_entries(source, prob["tables"], width)
    backend.sparse = StepSparse(cfg.ratio(layer), kv, keys, prob["selected_entries"].unsqueeze(1))
    captured = {}
    project = attn.project_out

    def capture(out, angles):
        captured["out"] = apply_rope(out, angles, inverse=True)[:, 0]
        return project(out, angles)

    attn.project_out = capture
    x = torch.randn(num_rows, cfg.hidden_size, generator=gen)
    with torch.no_grad():
        step.attend(attn, x)
        angles = rope_angles(pos, attn.freqs)
        q = apply_rope(
            attn.wq_b(attn.q_norm(attn.wq_a(x))).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim)), angles
        )
    ours = reference.sparse_decode_attention(
        q,
        prob["ring"],
        prob["slots"],
        pos,
        cfg.sliding_window,
        prob["kv_pool"],
        prob["selected"],
        attn.attn_sink,
        attn.freqs,
        cfg.head_dim**-0.5,
    )
    assert ours.shape == captured["out"].shape
    # Two torch formulations of one attention: fp32 order only (measured ≤ 4.8e-7 at max |out| 5.2: ~1 ulp).
    assert float((ours - captured["out"]).abs().max()) <= FP32_REORDER_REL * float(captured["out"].abs().max())
    assert float(captured["out"].abs().max()) > 0.1  # not trivially zero


# ---------------------------------------------------------------- interpreted kernel


def _tiny_problem(num_rows: int, seed: int, context: int = 40):
    cfg = dataclasses.replace(TINY, index_topk=24)  # several key blocks of 16
    gen = torch.Generator().manual_seed(seed)
    cache = CacheEngine(cfg, BLOCK_SIZE, num_blocks=64, num_state_slots=8, ring=ring_size(cfg))
    prob = _fill_cache(cache, cfg, 3, 2, num_rows, context, gen)
    prob["q"] = torch.randn(num_rows, cfg.num_attention_heads, cfg.head_dim, generator=gen)
    prob["sink"] = torch.randn(cfg.num_attention_heads, generator=gen)
    prob["freqs"] = rope_frequencies(cfg, compressed=True)
    return cfg, prob


def _args(cfg, prob, q=None):
    return (
        (prob["q"] if q is None else q),
        prob["ring"],
        prob["slots"],
        prob["pos"],
        cfg.sliding_window,
        prob["kv_pool"],
        prob["selected"],
        prob["sink"],
        prob["freqs"],
        cfg.head_dim**-0.5,
    )


@pytest.mark.parametrize("splits", [1, 2, 3, 64])  # 64: one block per split (one launch for both kinds)
def test_interpreted_fp32_dots_match_reference(splits):
    cfg, prob = _tiny_problem(5, splits)
    ref = reference.sparse_decode_attention(*_args(cfg, prob))
    out = torch.full_like(ref, float("nan"))
    with interpreter():
        load_interpreted("decode_attention").sparse_decode_attention(
            *_args(cfg, prob), out=out, block_n=16, splits=splits, dot_fp32=True
        )
    assert not out.isnan().any()
    assert float((out - ref).abs().max()) <= FP32_REORDER_REL * float(ref.abs().max())


def test_interpreted_bf16_in_and_out():
    """bf16 queries in, bf16 out (the interpreter casts fp32 → bf16 by truncation: < 2^-7 relative).

    The dots stay fp32 here: Triton 3.6's interpreter returns garbage for tl.dot on bf16 operands, so
    the bf16-operand path (the GPU default) is checked by the ``gpu`` test only.
    """
    cfg, prob = _tiny_problem(4, 7)
    q = prob["q"].to(torch.bfloat16)
    ref = reference.sparse_decode_attention(*_args(cfg, prob, q.float()))
    with interpreter():
        out = load_interpreted("decode_attention").sparse_decode_attention(
            *_args(cfg, prob, q), block_n=16, dot_fp32=True
        )
    assert out.dtype == torch.bfloat16
    assert torch.all((out.float() - ref).abs() <= BF16_CAST_REL * ref.abs() + FP32_REORDER_REL)


TINY_SHAPES = (("oracle", 3, 2), ("oracle", 6, 5), ("wide", 2, 1), ("nocand", 2, 1))
"""The FP8 engine test's tiny configs, a layer and its KV source each (H 4 / 8, rope 16 / 32, window 8 / 4 / 16)."""


def _tiny_config_problem(name: str, layer: int, source: int, device: str = "cpu"):
    """``_fill_cache`` for one of the tiny configs (6 rows, context 40), moved to ``device`` as the engine
    lays it out: the ring and pool are the CacheEngine's own strided views."""
    from tests.model.deepseek_v41.oracle_configs import CASES

    cfg = {c.name: c.cfg for c in CASES}[name]
    gen = torch.Generator().manual_seed(layer)
    cache = CacheEngine(cfg, BLOCK_SIZE, num_blocks=64, num_state_slots=8, ring=ring_size(cfg))
    prob = _fill_cache(cache, cfg, layer, source, 6, 40, gen)
    prob["q"] = torch.randn(6, cfg.num_attention_heads, cfg.head_dim, generator=gen)
    prob["sink"] = torch.randn(cfg.num_attention_heads, generator=gen)
    prob["freqs"] = rope_frequencies(cfg, compressed=True)
    cache.blocks, cache.slots = cache.blocks.to(device), cache.slots.to(device)
    prob = {key: value.to(device) for key, value in prob.items()}
    prob.update(ring=cache.ring(layer), kv_pool=cache.entries(source)[0])
    return cfg, prob


@pytest.mark.parametrize(("name", "layer", "source"), TINY_SHAPES)
def test_interpreted_bf16_dots_at_tiny_shapes_only_round_q_and_p(name, layer, source):
    """The bf16-dot path (the FP8 engine's) run line for line under an interpreter patched for exact bf16
    dots and round-to-nearest casts (tests/kernels/bf16_emulation.py), whole rows and split: only
    q → bf16 and P → bf16 away from the reference (a torch emulation of exactly those)."""
    from tests.kernels.bf16_emulation import bf16_interpreter, decode_bf16

    cfg, prob = _tiny_config_problem(name, layer, source)
    ref, emulated = reference.sparse_decode_attention(*_args(cfg, prob)), decode_bf16(*_args(cfg, prob))
    module = load_interpreted("decode_attention")
    for splits in (1, 3):
        with interpreter(), bf16_interpreter():
            out = module.sparse_decode_attention(*_args(cfg, prob), splits=splits, dot_fp32=False)
        assert out.isfinite().all()
        assert 3e-4 < _rel(out, ref) < BF16_PATH_REL  # the bf16 path ran, and rounds like bf16
        assert _rel(out, emulated) < BF16_EMULATION_REL  # measured ≤ 4e-4 (tests/tolerances.py)


def test_interpreted_row_without_keys_gives_zero():
    """Every window position below 0 and no selected entry: the sink takes all the weight."""
    cfg, prob = _tiny_problem(3, 11)
    prob["selected"][1] = -1
    prob["pos"][1] = -1  # no window position is ≥ 0
    ref = reference.sparse_decode_attention(*_args(cfg, prob))
    with interpreter():
        out = load_interpreted("decode_attention").sparse_decode_attention(*_args(cfg, prob), block_n=16, dot_fp32=True)
    assert torch.all(out[1] == 0) and torch.all(ref[1] == 0)
    assert float((out - ref).abs().max()) <= FP32_REORDER_REL * float(ref.abs().max())


# ---------------------------------------------------------------- GPU, Flash shapes


def test_flash_problem_builder_on_cpu():
    """The benchmark's Flash-shaped problem (also the GPU tests') is valid input: the reference runs on it,
    finite and not dominated by the sink, and the interpreted kernel agrees on a 2-row case."""
    from services.bench.kernels.decode_attention import decode_attention_args, decode_attention_problem

    p = decode_attention_problem(2, 4096, torch.Generator().manual_seed(0), device="cpu")
    p["pos"][0] = 5  # a row whose window is mostly before the start
    p["selected"][-1, 100:] = -1
    ref = reference.sparse_decode_attention(*decode_attention_args({**p, "q": p["q"].float()}))
    assert ref.isfinite().all() and float(ref.abs().mean()) > 1e-2
    out = torch.empty_like(ref)
    with interpreter():
        load_interpreted("decode_attention").sparse_decode_attention(
            *decode_attention_args(p), out=out, dot_fp32=True, splits=2
        )
    assert float((out - ref).abs().max()) <= FP32_REORDER_REL * float(ref.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("num_rows", "context"), [(1, 4096), (7, 4096), (32, 4096), (64, 32768), (256, 4096)])
def test_gpu_flash_shapes_match_reference(num_rows, context):
    from kernels.decode_attention import sparse_decode_attention
    from services.bench.kernels.decode_attention import decode_attention_args, decode_attention_problem

    p = decode_attention_problem(num_rows, context, torch.Generator("cuda").manual_seed(num_rows))
    p["pos"][0] = 5  # a row whose window is mostly before the start
    p["selected"][-1, 100:] = -1  # a row with fewer selected entries
    args = decode_attention_args(p)
    out = torch.full_like(p["q"], float("nan"))
    sparse_decode_attention(*args, out=out)
    ref32 = reference.sparse_decode_attention(*decode_attention_args({**p, "q": p["q"].float()}))
    assert not out.isnan().any()
    # bf16 P in the PV product and the bf16 output: ~1e-3 relative.
    assert _rel(out, ref32) < BF16_PATH_REL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("num_rows", "context"), [(7, 4096), (256, 4096)])
def test_gpu_fp32_dots_match_reference_exactly(num_rows, context):
    """fp32 dots and an fp32 output: only the summation order differs from the reference."""
    from kernels.decode_attention import sparse_decode_attention
    from services.bench.kernels.decode_attention import decode_attention_args, decode_attention_problem

    p = decode_attention_problem(num_rows, context, torch.Generator("cuda").manual_seed(num_rows))
    p["pos"][0] = 5
    p["selected"][-1, 100:] = -1
    args = decode_attention_args(p)
    ref32 = reference.sparse_decode_attention(*decode_attention_args({**p, "q": p["q"].float()}))
    exact = sparse_decode_attention(*args, dot_fp32=True, out=torch.full_like(ref32, float("nan")))
    assert float((exact - ref32).abs().max()) <= FP32_REORDER_REL * float(ref32.abs().max())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_replay_with_new_indices():
    """Captured once, replayed after the positions, slots and selections change in place."""
    from kernels.decode_attention import sparse_decode_attention
    from services.bench.kernels.decode_attention import decode_attention_args, decode_attention_problem

    gen = torch.Generator("cuda").manual_seed(5)
    p = decode_attention_problem(8, 4096, gen)
    args = decode_attention_args(p)
    out = torch.empty_like(p["q"])
    sparse_decode_attention(*args, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sparse_decode_attention(*args, out=out)
    other = decode_attention_problem(8, 4096, gen)
    p["pos"].copy_(torch.randint(0, 4096, (8,), device="cuda", generator=gen))
    p["selected"].copy_(other["selected"].flip(0))
    p["q"].copy_(other["q"])
    graph.replay()
    ref32 = reference.sparse_decode_attention(*decode_attention_args({**p, "q": p["q"].float()}))
    assert _rel(out, ref32) < BF16_PATH_REL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "layer", "source"), TINY_SHAPES)
def test_gpu_tiny_shapes_bf16_dots_only_round_q_and_p(name, layer, source):
    """The FP8 engine's tiny-model decode calls compiled (split by default at 6 rows, and whole rows):
    the bf16 path against the reference and the torch emulation of its two roundings."""
    from kernels.decode_attention import sparse_decode_attention
    from tests.kernels.bf16_emulation import decode_bf16

    cfg, prob = _tiny_config_problem(name, layer, source, "cuda")
    ref, emulated = reference.sparse_decode_attention(*_args(cfg, prob)), decode_bf16(*_args(cfg, prob))
    for splits in (None, 1):
        out = sparse_decode_attention(*_args(cfg, prob), splits=splits, out=torch.full_like(ref, float("nan")))
        assert out.isfinite().all()
        assert _rel(out, ref) < BF16_PATH_REL and _rel(out, emulated) < BF16_EMULATION_REL
