"""Sparse prefill attention vs ``kernels.reference.sparse_prefill_attention``: the reference against the
engine's cached attention (``AttentionStep.attend`` on the torch backend) for prefill chunks on the tiny model, the
kernel interpreted on CPU at small shapes, and compiled on a GPU at the Flash shapes (1K and 4K-row chunks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.quant import quantize_fp8_cache
from model.deepseek_v41.rope import rope_frequencies
from services.worker.state.cache_engine import CacheEngine, ring_size
from tests.tolerances import BF16_CAST_REL, BF16_EMULATION_REL, BF16_PATH_REL, FP32_REORDER_REL

BLOCK_SIZE = 16
# (first position this step, chunk rows) per request: a fresh prompt, chunks whose first windows reach
# into the ring, one longer than ring − window (its own ring writes would clobber keys its first rows
# need: the ring must be read before them), and a single-row (decode-like) request.
CHUNKS = ((5, 6), (0, 4), (20, 12), (9, 1))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _chunk_problem(cfg, layer: int, source: int, gen: torch.Generator, chunks=CHUNKS) -> dict:
    """A step of prefill chunks in a CacheEngine: rings hold each request's positions before its chunk,
    the pool its entries up to the end of its chunk; rows select ascending distinct visible entries
    (every third row none, others half or all of top-k). Step K rows are random, returned pre-rounding."""
    ratio, hd = cfg.ratio(layer) or 2, cfg.head_dim
    ring = ring_size(cfg)
    cache = CacheEngine(cfg, BLOCK_SIZE, num_blocks=64, num_state_slots=8, ring=ring)
    lay = cache.layout
    epb = lay.source(source).entries_per_block
    num_requests = len(chunks)
    slots = torch.randperm(7, generator=gen)[:num_requests] + 1
    ends = [f + n for f, n in chunks]
    width = -(-max(ends) // ratio // epb)
    tables = (torch.randperm(63, generator=gen)[: num_requests * width] + 1).view(num_requests, width)
    for i, (first, _) in enumerate(chunks):
        span = torch.arange(max(0, first - ring), first)
        k = torch.randn(span.numel(), hd, generator=gen) * 2
        cache.write_window(layer, slots[i].expand(span.numel()), span % ring, k)
        entries = torch.arange(ends[i] // ratio)
        cache.write_entries(
            source,
            tables[i, entries // epb] * epb + entries % epb,
            torch.randn(entries.numel(), hd, generator=gen),
            torch.randn(entries.numel(), cfg.index_head_dim, generator=gen),
        )
    row_requests = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(chunks)])
    pos = torch.cat([torch.arange(f, f + n) for f, n in chunks])
    first = torch.tensor([f for f, _ in chunks])
    topk = cfg.index_topk
    sel = torch.full((pos.numel(), topk), -1, dtype=torch.long)
    for r in range(pos.numel()):
        visible = (int(pos[r]) + 1) // ratio
        take = 0 if r % 3 == 1 else min(visible, topk if r % 3 else topk // 2)
        sel[r, :take] = torch.randperm(visible, generator=gen)[:take].sort().values
    return dict(
        cache=cache,
        ring=cache.ring(layer).clone(),
        slots=slots,
        tables=tables,
        row_requests=row_requests,
        pos=pos,
        first=first,
        selected_entries=sel,
        kv_pool=cache.entries(source)[0],
        selected=reference.entry_slots(sel, tables[row_requests], epb),
        k=torch.randn(pos.numel(), hd, generator=gen) * 2,
    )


def _args(cfg, prob, q, step_k, selected=None):
    rows = prob["row_requests"]
    return (
        q,
        step_k,
        prob["ring"],
        prob["slots"][rows],
        prob["pos"],
        prob["first"][rows],
        cfg.sliding_window,
        prob["kv_pool"],
        prob["selected"] if selected is None else selected,
        prob["sink"],
        prob["freqs"],
        cfg.head_dim**-0.5,
    )


# ---------------------------------------------------------------- the reference is the engine's attention


@pytest.mark.parametrize("layer", [3, 0])  # ratio 2 (source 2's entries and selection), ratio 0 (window only)
def test_reference_equals_torch_attention(layer):
    """The reference, given the ring before the step and the step's K rows as FP8 bytes, equals
    ``AttentionStep.attend`` on the torch backend on a step of prefill chunks, compared before the output projection."""
    from model.deepseek_v41.attention import Attention
    from model.deepseek_v41.rope import apply_rope, rope_angles
    from services.worker.attention.step import AttentionStep
    from services.worker.attention.torch_backend import StepSparse, TorchAttention
    from services.worker.batch.step_batch import StepBatch

    torch.manual_seed(0)
    cfg, source = TINY, 2
    gen = torch.Generator().manual_seed(layer + 1)
    prob = _chunk_problem(cfg, layer, source, gen)
    cache, pos, rows = prob["cache"], prob["pos"], prob["row_requests"]
    attn = Attention(cfg, layer)
    with torch.no_grad():
        attn.attn_sink.copy_(torch.randn(cfg.num_attention_heads, generator=gen))
    counts = torch.tensor([n for _, n in CHUNKS])
    batch = StepBatch(
        request_ids=[f"r{i}" for i in range(len(CHUNKS))],
        input_ids=torch.zeros(pos.numel(), dtype=torch.long),
        positions=pos,
        row_requests=rows,
        ring_slots=pos % cache.layout.ring_size,
        query_start=torch.cat((torch.zeros(1, dtype=torch.long), counts.cumsum(0))),
        first=prob["first"],
        seqlens_k=prob["first"] + counts,
        state_slots=prob["slots"],
        block_tables=prob["tables"],
        sample_rows=torch.arange(pos.numel()),
        entry_writes={},
    )
    backend = TorchAttention(cache, batch)
    step = AttentionStep(backend, batch.positions, batch.row_requests)
    if attn.ratio:
        width = int((batch.seqlens_k // attn.ratio).max())
        kv, keys = cache.read_entries(source, prob["tables"], width)
        backend.sparse = StepSparse(attn.ratio, kv, keys, prob["selected_entries"].unsqueeze(1))
    captured = {}
    project = attn.project_out

    def capture(out, angles):
        captured["out"] = apply_rope(out, angles, inverse=True)[:, 0]
        return project(out, angles)

    attn.project_out = capture
    x = torch.randn(pos.numel(), cfg.hidden_size, generator=gen)
    with torch.no_grad():
        step.attend(attn, x)
        angles = rope_angles(pos, attn.freqs)
        q = apply_rope(
            attn.wq_b(attn.q_norm(attn.wq_a(x))).unflatten(-1, (cfg.num_attention_heads, cfg.head_dim)), angles
        )
        k = apply_rope(attn.kv_norm(attn.wkv(x)), angles)
    prob.update(sink=attn.attn_sink, freqs=attn.freqs)
    selected = None if attn.ratio else prob["selected"][:, :0]
    with torch.no_grad():
        ours = reference.sparse_prefill_attention(*_args(cfg, prob, q, quantize_fp8_cache(k), selected))
    assert ours.shape == captured["out"].shape
    # Two torch formulations of one attention: fp32 order only (measured ≤ 4.8e-7 at max |out| 5.2: ~1 ulp).
    assert float((ours - captured["out"]).abs().max()) <= FP32_REORDER_REL * float(captured["out"].abs().max())
    assert float(captured["out"].abs().max()) > 0.1  # not trivially zero


# ---------------------------------------------------------------- interpreted kernel


def _tiny(seed: int, window: int = 8, chunks=CHUNKS):
    cfg = dataclasses.replace(TINY, index_topk=24, sliding_window=window)  # several entry blocks of 16
    gen = torch.Generator().manual_seed(seed)
    prob = _chunk_problem(cfg, 3, 2, gen, chunks)
    prob["q"] = torch.randn(prob["pos"].numel(), cfg.num_attention_heads, cfg.head_dim, generator=gen)
    prob["sink"] = torch.randn(cfg.num_attention_heads, generator=gen)
    prob["freqs"] = rope_frequencies(cfg, compressed=True)
    return cfg, prob


@pytest.mark.parametrize(("window", "window_only"), [(8, False), (20, False), (8, True)])
def test_interpreted_fp32_dots_match_reference(window, window_only):
    """window 20: two key blocks of 16, the second straddling ring and step rows; window only: a ratio-0 layer."""
    cfg, prob = _tiny(window, window)
    selected = prob["selected"][:, :0] if window_only else None
    args = _args(cfg, prob, prob["q"], quantize_fp8_cache(prob["k"]), selected)
    ref = reference.sparse_prefill_attention(*args)
    out = torch.full_like(ref, float("nan"))
    with interpreter():
        load_interpreted("prefill_attention").sparse_prefill_attention(*args, out=out, dot_fp32=True)
    assert not out.isnan().any()
    assert float((out - ref).abs().max()) <= FP32_REORDER_REL * float(ref.abs().max())


def test_interpreted_staged_entries_match_reference():
    """Entries dequantised once for the step (``stage_entries``) and gathered as rows: the same result."""
    cfg, prob = _tiny(5)
    module = load_interpreted("prefill_attention")
    staged, index = module.stage_entries(
        prob["kv_pool"], prob["tables"], prob["selected_entries"], prob["row_requests"], torch.float32
    )
    assert bool(((index >= 0) == (prob["selected"] >= 0)).all())
    args = _args(cfg, prob, prob["q"], quantize_fp8_cache(prob["k"]))
    ref = reference.sparse_prefill_attention(*args)
    out = torch.full_like(ref, float("nan"))
    with interpreter():
        module.sparse_prefill_attention(*args[:8], index, *args[9:], out=out, dot_fp32=True, staged=staged)
    assert float((out - ref).abs().max()) <= FP32_REORDER_REL * float(ref.abs().max())


def _staged_window(module, cfg, prob, step_k, dtype=torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    rows = prob["row_requests"]
    return module.stage_window(
        step_k,
        prob["ring"],
        prob["slots"][rows],
        prob["pos"],
        prob["first"][rows],
        cfg.sliding_window,
        rows,
        len(prob["first"]),
        dtype,
    )


# Five requests: two fresh prompts (one a single row), chunks starting mid-request whose first windows
# reach into the ring, wholly (40) or partly (3: positions before 0), and one longer than ring − window.
MORE_CHUNKS = ((40, 3), (0, 1), (3, 9), (0, 5), (27, 30))


@pytest.mark.parametrize(
    ("window", "chunks", "mode"),
    [
        (8, CHUNKS, "in-loop entries"),
        (20, CHUNKS, "in-loop entries"),
        (8, CHUNKS, "window only"),
        (20, MORE_CHUNKS, "staged entries"),
        (4, MORE_CHUNKS, "window only"),
        (16, MORE_CHUNKS, "in-loop entries"),
    ],
)
def test_interpreted_staged_window_is_bit_identical(window, chunks, mode):
    """Window keys dequantised once for the step (``stage_window``) and gathered as rows give the in-loop
    dequantisation's result bit for bit (the same keys, blocks and order): several requests in one
    step, chunks starting mid-request (ring rows in their windows), windows reaching before position 0,
    one-row requests; window 20 spans two key blocks of 16 (32 with staged entries), the second
    straddling ring and step rows; window-only layers (top-k 0); entries in-loop or staged."""
    cfg, prob = _tiny(window + len(chunks), window, chunks)
    module = load_interpreted("prefill_attention")
    step_k = quantize_fp8_cache(prob["k"])
    selected = prob["selected"][:, :0] if mode == "window only" else prob["selected"]
    ref = reference.sparse_prefill_attention(*_args(cfg, prob, prob["q"], step_k, selected))
    args = list(_args(cfg, prob, prob["q"], step_k, selected))
    staged = None
    if mode == "staged entries":
        staged, args[8] = module.stage_entries(
            prob["kv_pool"], prob["tables"], prob["selected_entries"], prob["row_requests"], torch.float32
        )
    with interpreter():
        keys, rows = _staged_window(module, cfg, prob, step_k)
        loop, gathered = (
            module.sparse_prefill_attention(
                *args, dot_fp32=True, staged=staged, staged_window=keys_rows, out=torch.full_like(ref, float("nan"))
            )
            for keys_rows in (None, (keys, rows))
        )
    assert keys.shape == (len(prob["pos"]) + len(chunks) * (window - 1), cfg.head_dim)
    assert not gathered.isnan().any() and torch.equal(gathered, loop)
    assert float((gathered - ref).abs().max()) <= FP32_REORDER_REL * float(ref.abs().max())  # and right


def test_interpreted_bf16_in_and_out():
    """bf16 queries in, bf16 out (the interpreter casts fp32 → bf16 by truncation: < 2^-7 relative); the
    dots stay fp32 (bf16 tl.dot is garbage under Triton 3.6's interpreter: checked on the GPU only)."""
    cfg, prob = _tiny(7)
    q = prob["q"].to(torch.bfloat16)
    step_k = quantize_fp8_cache(prob["k"])
    ref = reference.sparse_prefill_attention(*_args(cfg, prob, q.float(), step_k))
    with interpreter():
        out = load_interpreted("prefill_attention").sparse_prefill_attention(
            *_args(cfg, prob, q, step_k), dot_fp32=True
        )
    assert out.dtype == torch.bfloat16
    assert torch.all((out.float() - ref).abs() <= BF16_CAST_REL * ref.abs() + FP32_REORDER_REL)


TINY_SHAPES = (("oracle", 3, 2), ("oracle", 6, 5), ("wide", 2, 1), ("nocand", 2, 1))
"""The FP8 engine test's tiny configs (tests/model/deepseek_v41/oracle_configs.py), a layer and its KV
source each: H 4 / 8 (BLOCK_H 16 masks the rest), head dim 64, rope 16 / 32, window 8 / 4 / 16, top-k 4 / 5 / 3."""


def _tiny_config_problem(name: str, layer: int, source: int, device: str = "cpu"):
    """``_chunk_problem`` for one of the tiny configs, on ``device``: the ring and pool are the CacheEngine's
    own views (its strides and alignment, as the engine passes them)."""
    from model.deepseek_v41.quant import quantize_fp8_cache
    from tests.model.deepseek_v41.oracle_configs import CASES

    cfg = {c.name: c.cfg for c in CASES}[name]
    gen = torch.Generator().manual_seed(layer)
    prob = _chunk_problem(cfg, layer, source, gen)
    heads = cfg.num_attention_heads
    prob["q"] = torch.randn(prob["pos"].numel(), heads, cfg.head_dim, generator=gen)
    prob["sink"] = torch.randn(heads, generator=gen)
    prob["freqs"] = rope_frequencies(cfg, compressed=bool(cfg.ratio(layer)))
    cache = prob["cache"]
    cache.blocks, cache.slots = cache.blocks.to(device), cache.slots.to(device)
    prob.update({key: value.to(device) for key, value in prob.items() if isinstance(value, torch.Tensor)})
    prob.update(ring=cache.ring(layer), kv_pool=cache.entries(source)[0])
    return cfg, prob, quantize_fp8_cache(prob["k"])


@pytest.mark.parametrize(("name", "layer", "source"), TINY_SHAPES)
def test_interpreted_bf16_dots_at_tiny_shapes_only_round_q_and_p(name, layer, source):
    """The bf16-dot path (the FP8 engine's), run line for line under an interpreter patched for exact bf16
    dots and round-to-nearest casts (tests/kernels/bf16_emulation.py): it differs from the fp32
    reference only by q → bf16 and P → bf16 (a torch emulation of exactly those), at each tiny
    config's shapes, where the Flash-shaped GPU tests do not reach (masked heads, D 64, short windows)."""
    from tests.kernels.bf16_emulation import bf16_interpreter, prefill_bf16

    cfg, prob, step_k = _tiny_config_problem(name, layer, source)
    args = _args(cfg, prob, prob["q"], step_k)
    ref, emulated = reference.sparse_prefill_attention(*args), prefill_bf16(*args)
    with interpreter(), bf16_interpreter():
        out = load_interpreted("prefill_attention").sparse_prefill_attention(*args, dot_fp32=False)
    assert out.isfinite().all()
    assert 3e-4 < _rel(out, ref) < BF16_PATH_REL  # the bf16 path ran, and rounds like bf16
    assert _rel(out, emulated) < BF16_EMULATION_REL  # measured ≤ 2.3e-4 (tests/tolerances.py)


@pytest.mark.parametrize(("name", "layer", "source"), TINY_SHAPES)
def test_interpreted_bf16_staged_window_is_bit_identical(name, layer, source):
    """The bf16-dot path (bf16 staged keys, RNE casts as compiled code rounds: bf16_emulation.py) at each
    tiny config's shapes: staged window keys give the in-loop path's bits, window-only layers too."""
    from tests.kernels.bf16_emulation import bf16_interpreter

    cfg, prob, step_k = _tiny_config_problem(name, layer, source)
    module = load_interpreted("prefill_attention")
    for selected in (prob["selected"], prob["selected"][:, :0]):
        args = _args(cfg, prob, prob["q"], step_k, selected)
        with interpreter(), bf16_interpreter():
            window = _staged_window(module, cfg, prob, step_k, torch.bfloat16)
            loop = module.sparse_prefill_attention(*args)
            gathered = module.sparse_prefill_attention(*args, staged_window=window)
        assert window[0].dtype == torch.bfloat16 and loop.isfinite().all()
        assert torch.equal(gathered, loop)


def test_bench_problem_builder_on_cpu():
    """The benchmark's problem (also the GPU tests') at 4 heads × 64, an 8-row chunk of a 1,100-token
    context, is valid input: every row takes 512 ascending distinct entries of its ≥ 546 visible ones,
    the reference is finite and not sink-dominated, and the kernel agrees."""
    from services.bench.kernels.prefill_attention import prefill_attention_args, prefill_attention_problem

    p = prefill_attention_problem(8, 1100, torch.Generator().manual_seed(0), device="cpu", num_heads=4, head_dim=64)
    assert bool((p["selected"] >= 0).all()) and bool((p["entries"].diff(dim=1) > 0).all())
    args = prefill_attention_args({**p, "q": p["q"].float()})
    ref = reference.sparse_prefill_attention(*args)
    assert ref.isfinite().all() and float(ref.abs().mean()) > 1e-2
    out = torch.empty_like(ref)
    with interpreter():
        load_interpreted("prefill_attention").sparse_prefill_attention(*args, out=out, dot_fp32=True, block_n=64)
    assert float((out - ref).abs().max()) <= FP32_REORDER_REL * float(ref.abs().max())


# ---------------------------------------------------------------- GPU, Flash shapes


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("chunk", "context"), [(1024, 4096), (4096, 4096), (1024, 32768)])
def test_gpu_flash_shapes_match_reference(chunk, context):
    from kernels.prefill_attention import sparse_prefill_attention, stage_entries
    from services.bench.kernels.prefill_attention import prefill_attention_args, prefill_attention_problem

    p = prefill_attention_problem(chunk, context, torch.Generator("cuda").manual_seed(chunk))
    p["selected"][-1, 100:] = -1  # a row with fewer selected entries
    p["selected"][-2] = -1  # a row with none
    args = prefill_attention_args(p)
    out = torch.full_like(p["q"], float("nan"))
    sparse_prefill_attention(*args, out=out)
    ref32 = reference.sparse_prefill_attention(*prefill_attention_args({**p, "q": p["q"].float()}))
    assert not out.isnan().any()
    assert _rel(out, ref32) < BF16_PATH_REL  # bf16 P in the PV product and the bf16 output: ~1e-3 relative
    # fp32 dots and an fp32 output: only the summation order differs from the reference.
    exact = sparse_prefill_attention(*args, dot_fp32=True, out=torch.full_like(ref32, float("nan")))
    assert float((exact - ref32).abs().max()) <= FP32_REORDER_REL * float(ref32.abs().max())
    # Entries dequantised once for the step (bf16 holds them exactly) and gathered as rows.
    staged, index = stage_entries(p["kv_pool"], p["table"][None], p["entries"], torch.zeros_like(p["pos"]))
    index[-1, 100:], index[-2] = -1, -1
    assert _rel(sparse_prefill_attention(*args[:8], index, *args[9:], staged=staged), ref32) < BF16_PATH_REL
    # A ratio-0 layer: the window alone.
    window_only = (*args[:8], p["selected"][:, :0], *args[9:])
    ref_w = reference.sparse_prefill_attention(
        *prefill_attention_args({**p, "q": p["q"].float(), "selected": p["selected"][:, :0]})
    )
    assert _rel(sparse_prefill_attention(*window_only), ref_w) < BF16_PATH_REL


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("chunk", "context"), [(1024, 4096), (4096, 4096)])
def test_gpu_flash_shapes_staged_window_is_bit_identical(chunk, context):
    """Compiled at Flash's shapes (64 heads, head dim 512, window 128, top-k 512): window keys staged once
    (``stage_window``) give the in-loop path's bits, with entries in the loop (key blocks of 16) or staged
    (32), bf16 or fp32 dots, and for a window-only layer. The chunk's rows are split into three requests,
    each with its own first row (ring rows in its windows) and slot, so several segments are staged;
    both paths read the same bytes. 4096 of 4096: windows reaching before position 0."""
    from kernels.prefill_attention import sparse_prefill_attention, stage_entries, stage_window
    from services.bench.kernels.prefill_attention import prefill_attention_args, prefill_attention_problem

    p = prefill_attention_problem(chunk, context, torch.Generator("cuda").manual_seed(chunk))
    cuts = (0, chunk // 4, chunk // 2 + 1, chunk)
    reqs = torch.cat([torch.full((b - a,), i, device="cuda") for i, (a, b) in enumerate(zip(cuts, cuts[1:]))])
    p.update(first=p["pos"][torch.tensor(cuts[:-1], device="cuda")][reqs], slots=(reqs != 1).long())  # 1: slot 0
    args = prefill_attention_args(p)
    staged, index = stage_entries(p["kv_pool"], p["table"][None], p["entries"], torch.zeros_like(p["pos"]))
    calls = (
        (args, {}),
        ((*args[:8], index, *args[9:]), {"staged": staged}),
        ((*args[:8], p["selected"][:, :0], *args[9:]), {}),
        (args, {"dot_fp32": True}),
    )
    for call, kwargs in calls:
        dtype = torch.float32 if kwargs.get("dot_fp32") else torch.bfloat16
        window = stage_window(p["step_k"], p["ring"], p["slots"], p["pos"], p["first"], p["window"], reqs, 3, dtype)
        loop = sparse_prefill_attention(*call, **kwargs)
        assert loop.isfinite().all() and float(loop.float().abs().max()) > 0
        assert torch.equal(sparse_prefill_attention(*call, **kwargs, staged_window=window), loop), kwargs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("name", "layer", "source"), TINY_SHAPES)
def test_gpu_tiny_shapes_bf16_dots_only_round_q_and_p(name, layer, source):
    """The FP8 engine's tiny-model calls (BLOCK_H 16 over 4 or 8 heads, D 64, one key block, mma.sync
    instead of wgmma) compiled: the bf16 path against the fp32 reference and against the torch
    emulation of its two roundings; the fp32-dot path against the reference exactly."""
    from kernels.prefill_attention import sparse_prefill_attention
    from tests.kernels.bf16_emulation import prefill_bf16

    cfg, prob, step_k = _tiny_config_problem(name, layer, source, "cuda")
    args = _args(cfg, prob, prob["q"], step_k)
    ref, emulated = reference.sparse_prefill_attention(*args), prefill_bf16(*args)
    out = sparse_prefill_attention(*args, out=torch.full_like(ref, float("nan")))
    assert out.isfinite().all()
    assert _rel(out, ref) < BF16_PATH_REL and _rel(out, emulated) < BF16_EMULATION_REL
    exact = sparse_prefill_attention(*args, dot_fp32=True, out=torch.full_like(ref, float("nan")))
    assert float((exact - ref).abs().max()) <= FP32_REORDER_REL * float(ref.abs().max())
