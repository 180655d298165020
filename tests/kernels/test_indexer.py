"""Indexer scoring + top-k (``kernels/indexer.py``) vs ``kernels.reference.indexer_select`` (the model's
functions): the reference's key gather against ``CacheEngine.read_entries``, the kernels interpreted
on CPU at small shapes, and compiled on a GPU at the V41 Flash shapes (Hi 32, di 128, top-k 512,
2048 candidate blocks of 8)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted
from model.deepseek_v41.indexer import select_entries
from model.deepseek_v41.quant import INDEXER_BLOCK, fake_quant_indexer, quantize_fp4_cache
from tests.tolerances import FP32_REORDER_REL

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def indexer_problem(
    num_rows: int,
    heads: int,
    dim: int,
    epb: int,
    ratio: int,
    context: int,
    gen: torch.Generator,
    device: str = "cpu",
    positions: torch.Tensor | None = None,
) -> dict:
    """Random FP4 keys written into a pool in the cache's byte layout (other bytes between blocks), each
    row with its own shuffled block table over ``context // ratio`` entries; FP4-rounded queries."""
    rng: dict[str, Any] = dict(generator=gen, device=device)
    key_bytes = dim // 2 + dim // INDEXER_BLOCK
    width = context // ratio
    per_row = -(-width // epb)
    num_blocks = num_rows * per_row + 1
    storage = torch.randint(0, 256, (num_blocks, epb * key_bytes + 48), **rng, dtype=torch.uint8)
    pool = storage[:, 16 : 16 + epb * key_bytes].view(num_blocks, epb, key_bytes)
    tables = (torch.randperm(num_blocks - 1, **rng)[: num_rows * per_row] + 1).view(num_rows, per_row).to(torch.int32)
    e = torch.arange(width, device=device)
    packed, scale = quantize_fp4_cache(torch.randn(num_rows, width, dim, **rng), INDEXER_BLOCK, "e8m0")
    pool[tables.long()[:, e // epb], e % epb] = torch.cat((packed, scale.view(torch.uint8)), -1)
    if positions is None:
        positions = torch.randint(0, context, (num_rows,), **rng)
        positions[-1] = context - 1
    q = fake_quant_indexer(torch.randn(num_rows, heads, dim, **rng))
    w = torch.randn(num_rows, heads, **rng) * (dim * heads) ** -0.5
    return dict(q=q, w=w, key_pool=pool, block_tables=tables, positions=positions, ratio=ratio, width=width)


def _args(p: dict) -> tuple:
    return p["q"], p["w"], p["key_pool"], p["block_tables"], p["positions"], p["ratio"], p["width"]


def _check_selection(
    ours: torch.Tensor, ref_sel: torch.Tensor, our_scores: torch.Tensor, ref_scores: torch.Tensor, rel_gap: float = 1e-5
) -> None:
    """Ours picks exactly what select_entries picks on our scores, and the reference's pick in every row
    whose k-th and (k+1)-th best finite reference scores are more than rel_gap apart. In the other rows
    (close scores may swap by fp32 summation order: at 32K entries a tenth of rows have such a pair at
    the cut) every entry picked by one side only must score within rel_gap of the reference's k-th."""
    assert ours.shape == ref_sel.shape and ours.dtype == torch.int32
    assert torch.equal(ours.long(), select_entries(our_scores, ref_sel.shape[-1]))
    finite = ref_scores.isfinite()
    assert torch.equal(our_scores.isfinite(), finite)
    scale = float(ref_scores[finite].abs().max()) if finite.any() else 1.0
    torch.testing.assert_close(our_scores[finite], ref_scores[finite], rtol=FP32_REORDER_REL, atol=1e-6 * scale)
    k = ref_sel.shape[-1]
    for r in range(ours.shape[0]):
        s = ref_scores[r][finite[r]].sort(descending=True).values
        if s.numel() <= k or float(s[k - 1] - s[k]) > rel_gap * scale:
            assert torch.equal(ours[r].long(), ref_sel[r]), r
            continue
        mine, theirs = set(ours[r].tolist()) - {-1}, set(ref_sel[r].tolist()) - {-1}
        swapped = torch.tensor(sorted(mine ^ theirs), dtype=torch.long, device=ref_scores.device)
        if swapped.numel():
            gap = (ref_scores[r, swapped] - s[k - 1]).abs().max()
            assert float(gap) <= 2 * rel_gap * scale, (r, float(gap), rel_gap * scale)


# ---------------------------------------------------------------- the reference reads what the engine reads


def test_reference_keys_equal_cache_engine_read_entries():
    """The reference's pool gather + dequantisation equals ``CacheEngine.read_entries`` (tiny, layer 2)."""
    from model.deepseek_v41.presets import TINY
    from services.worker.state.cache_engine import CacheEngine, ring_size

    gen = torch.Generator().manual_seed(0)
    cache = CacheEngine(TINY, 16, num_blocks=20, num_state_slots=4, ring=ring_size(TINY))
    epb = cache.layout.source(2).entries_per_block
    tables = torch.randperm(19, generator=gen)[:12].view(2, 6) + 1
    slots = (tables[:, :, None] * epb + torch.arange(epb)).flatten()
    cache.write_entries(
        2,
        slots,
        torch.randn(slots.numel(), TINY.head_dim, generator=gen),
        torch.randn(slots.numel(), TINY.index_head_dim, generator=gen),
    )
    width = 6 * epb - 3
    _, keys = cache.read_entries(2, tables, width)
    q = torch.zeros(2, TINY.index_n_heads, TINY.index_head_dim)
    q[:, 0] = torch.eye(TINY.index_head_dim)[:2]  # head 0 reads channel r of row r's keys
    w = torch.zeros(2, TINY.index_n_heads)
    w[:, 0] = 1.0
    scores, _, _ = reference.indexer_select(
        q, w, cache.entries(2)[1], tables, torch.full((2,), 10**6), 1, width, index_topk=4
    )
    assert torch.equal(scores, keys[torch.arange(2), :, torch.arange(2)].relu())


# ---------------------------------------------------------------- interpreted kernels


@pytest.mark.parametrize(
    ("heads", "dim", "epb", "ratio", "context"), [(8, 32, 4, 1, 96), (4, 64, 8, 2, 200), (16, 128, 16, 1, 100)]
)
def test_interpreted_selection_matches_reference(heads, dim, epb, ratio, context):
    gen = torch.Generator().manual_seed(heads + dim + ratio)
    p = indexer_problem(5, heads, dim, epb, ratio, context, gen)
    p["positions"][0] = ratio - 2  # a row with no visible entry (ratio 1: position −1, ratio 2: position 0)
    p["positions"][1] = 5  # fewer visible entries than k
    topk = 16
    ref_scores, ref_sel, _ = reference.indexer_select(*_args(p), index_topk=topk)
    mod = load_interpreted("indexer")
    with interpreter():
        scores, _ = mod.indexer_scores(*_args(p), block_n=32, dot_fp32=True)
        sel = mod.select_topk(scores, topk)
    _check_selection(sel, ref_sel, scores, ref_scores)
    assert torch.all(sel[0] == -1) and (sel[1] >= 0).sum() == (6 // ratio)


def test_interpreted_candidate_source_and_user():
    """Layer-1 candidate blocks (the newest forced in, ties to lower blocks) and a later layer that
    scores only inside them, with candidate_topk_blocks below the number of visible blocks."""
    gen = torch.Generator().manual_seed(7)
    p = indexer_problem(4, 8, 32, 8, 1, 120, gen)
    p["positions"][:] = torch.tensor([0, 37, 90, 119])
    kw = dict(index_topk=12, candidate_block_size=4, candidate_topk_blocks=5)
    ref_scores, ref_sel, ref_cand = reference.indexer_select(*_args(p), candidate_source=True, **kw)
    mod = load_interpreted("indexer")
    with interpreter():
        sel, cand = mod.indexer_select(*_args(p), candidate_source=True, block_n=16, dot_fp32=True, **kw)
        scores, _ = mod.indexer_scores(*_args(p), block_n=16, dot_fp32=True)
    _check_selection(sel, ref_sel, scores, ref_scores)
    assert torch.equal(mod.candidate_entries(cand, p["positions"], 1, p["width"], 4), ref_cand)
    assert int(cand[0].sum()) == 1 and int(cand[3].sum()) == 5

    later = indexer_problem(4, 8, 32, 8, 1, 120, torch.Generator().manual_seed(8), positions=p["positions"])
    ref_scores, ref_sel, _ = reference.indexer_select(*_args(later), candidates=ref_cand, **kw)
    with interpreter():
        sel, passed = mod.indexer_select(*_args(later), candidates=cand, block_n=16, dot_fp32=True, **kw)
        scores, _ = mod.indexer_scores(
            *_args(later), candidates=cand, candidate_block_size=4, block_n=16, dot_fp32=True
        )
    assert passed is cand
    _check_selection(sel, ref_sel, scores, ref_scores)


def test_interpreted_ties_go_to_the_lower_index():
    """Equal scores: a zero query (every score +0 or −0) picks the first k visible entries; duplicated
    keys tie exactly and the lower copy wins; equal block maxima keep the lower blocks."""
    gen = torch.Generator().manual_seed(3)
    p = indexer_problem(3, 8, 32, 4, 1, 64, gen)
    p["positions"][:] = torch.tensor([40, 63, 63])
    p["q"][0] = 0.0
    p["w"][0, ::2] *= -1  # 0 · negative w is −0: still a tie with +0
    pool, tables = p["key_pool"], p["block_tables"].long()
    best = 9  # copy row 1's entry 9 over entries 20, 30, 50 (the same bytes: exactly equal scores)
    for j in (20, 30, 50):
        pool[tables[1, j // 4], j % 4] = pool[tables[1, best // 4], best % 4]
    p["q"][2] = 0.0  # row 2: every block max ties; the newest block is forced in
    kw = dict(index_topk=8, candidate_block_size=4, candidate_topk_blocks=3)
    ref_scores, ref_sel, ref_cand = reference.indexer_select(*_args(p), candidate_source=True, **kw)
    mod = load_interpreted("indexer")
    with interpreter():
        sel, cand = mod.indexer_select(*_args(p), candidate_source=True, block_n=16, dot_fp32=True, **kw)
    assert torch.equal(sel[0].long(), torch.arange(8))
    assert torch.equal(sel.long(), ref_sel)
    assert torch.equal(mod.candidate_entries(cand, p["positions"], 1, p["width"], 4), ref_cand)
    assert cand[2].nonzero().flatten().tolist() == [0, 1, 15]


def _scaled_args_match(mod, p: dict, scale: float, **kw) -> None:
    """``w_scale`` folded into the kernel gives the bits of scoring torch's ``w * scale``: scores, block
    maxima and selection ``==``."""
    args, scaled = _args(p), _args({**p, "w": p["w"] * scale})
    want = mod.indexer_scores(*scaled, block_max=True, candidate_block_size=4, **kw)
    got = mod.indexer_scores(*args, block_max=True, candidate_block_size=4, w_scale=scale, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    sel = mod.indexer_select(
        *args, index_topk=8, candidate_source=True, candidate_block_size=4, candidate_topk_blocks=3, w_scale=scale, **kw
    )
    ref = mod.indexer_select(
        *scaled, index_topk=8, candidate_source=True, candidate_block_size=4, candidate_topk_blocks=3, **kw
    )
    assert torch.equal(sel[0], ref[0]) and torch.equal(sel[1], ref[1])


@pytest.mark.parametrize(("heads", "dim"), [(8, 32), (16, 128), (4, 64)])
def test_interpreted_w_scale_equals_torch_scaled_w(heads, dim):
    """The indexer's (di·Hi)^-1/2 multiplied as the kernel loads w is torch's fp32 ``w * scale``, bit for
    bit (a scale that is not a power of two, so the product rounds; w's signs and a zero w included)."""
    gen = torch.Generator().manual_seed(heads + dim)
    p = indexer_problem(4, heads, dim, 4, 1, 64, gen)
    p["w"][0, ::2] *= -1
    p["w"][1, 0] = 0.0
    mod = load_interpreted("indexer")
    with interpreter():
        _scaled_args_match(mod, p, dim**-0.5 * heads**-0.5, block_n=16, dot_fp32=True)
        with pytest.raises(ValueError, match="w_scale"):
            mod.indexer_scores(*_args({**p, "w": p["w"].bfloat16()}), w_scale=0.5, block_n=16, dot_fp32=True)


@pytest.mark.parametrize("atomic", [True, False])
def test_select_topk_interpreted_exhaustive_ties(atomic):
    """select_topk alone on hand-made rows: all −∞, fewer finite than k, many equal values, −0 vs +0;
    both compactions (atomic slots + sort, prefix sums)."""
    scores = torch.full((4, 40), -torch.inf)
    scores[1, [3, 7, 11]] = torch.tensor([1.0, -2.0, 0.5])
    scores[2, :] = torch.tensor([1.0, 2.0, 2.0, 0.0, -0.0] * 8)
    scores[3, :] = torch.randn(40, generator=torch.Generator().manual_seed(1))
    scores[3, 5] = scores[3, 6] = scores[3].max()
    mod = load_interpreted("indexer")
    with interpreter():
        sel = mod.select_topk(scores, 10, atomic=atomic)
        mask = mod.select_topk(scores, 10, as_mask=True)
    assert torch.equal(sel.long(), select_entries(scores, 10))
    ref_mask = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, select_entries(scores, 10).clamp_min(0), True)
    ref_mask[0] = False
    ref_mask[1] = scores[1].isfinite()
    assert torch.equal(mask.bool(), ref_mask)


@pytest.mark.parametrize("width", [64, 100])
def test_select_topk_interpreted_rows_wider_than_one_program(width):
    """Rows wider than ``row_max`` (here 32, 65,536 on the GPU) cut into pieces: the same picks as one pass,
    ties across pieces to the lower index, −∞ and short rows padded with −1, the mask form too."""
    gen = torch.Generator().manual_seed(3)
    scores = torch.randint(-4, 5, (4, width), generator=gen).float()  # many ties, across pieces
    scores[1, :] = -torch.inf
    scores[1, [2, 40, 63]] = torch.tensor([0.5, 1.0, 0.5])
    scores[2, 5::3] = -torch.inf
    mod = load_interpreted("indexer")
    with interpreter():
        sel = mod.select_topk(scores, 10, row_max=32)
        sel_wide = mod.select_topk(scores, 10, out_width=10, row_max=32, atomic=False)
        mask = mod.select_topk(scores, 10, as_mask=True, row_max=32)
        whole = mod.select_topk(scores, 10)
    ref = select_entries(scores, 10)
    assert torch.equal(sel.long(), ref) and torch.equal(sel_wide.long(), ref) and torch.equal(whole, sel)
    assert torch.equal(sel[1, :3], torch.tensor([2, 40, 63], dtype=torch.int32)) and torch.all(sel[1, 3:] == -1)
    ref_mask = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, ref.clamp_min(0), True)
    ref_mask[1] = scores[1].isfinite()
    assert torch.equal(mask.bool(), ref_mask)


# ---------------------------------------------------------------- GPU, Flash shapes


def test_flash_bench_problem_builds_on_cpu():
    """The benchmark's problem (Flash sizes, reduced rows and context) is valid input to the reference."""
    from services.bench.kernels.indexer import indexer_bench_problem

    p = indexer_bench_problem(2, 512, 1, torch.Generator().manual_seed(0), device="cpu")
    scores, sel, _ = reference.indexer_select(*_args(p), index_topk=512)
    assert scores.isfinite().all() and float(scores.abs().max()) > 0
    assert torch.equal(sel[0], torch.arange(512))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_rows", [1, 64, 256])
@pytest.mark.parametrize(("context", "ratio"), [(4096, 2), (32768, 2), (4096, 1), (32768, 1)])
def test_gpu_flash_selection_matches_reference(num_rows, context, ratio):
    """Flash shapes on a pool written by the cache's quantiser; positions spread below the context."""
    from kernels.indexer import indexer_scores, indexer_select

    gen = torch.Generator(device="cuda").manual_seed(num_rows + context + ratio)
    p = indexer_problem(num_rows, 32, 128, 128 // ratio, ratio, context, gen, device="cuda")
    ref_scores, ref_sel, _ = reference.indexer_select(*_args(p), index_topk=512)
    scores, _ = indexer_scores(*_args(p))
    sel, _ = indexer_select(*_args(p), index_topk=512)
    _check_selection(sel, ref_sel, scores, ref_scores)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_rows", [1, 64, 256])
@pytest.mark.parametrize("context", [4096, 32768])
def test_gpu_flash_candidates_match_reference(num_rows, context):
    """The candidate source (layer 20, ratio 1: 2048 blocks of 8) and a later layer inside its blocks."""
    from kernels.indexer import candidate_entries, indexer_scores, indexer_select

    gen = torch.Generator(device="cuda").manual_seed(num_rows * 3 + context)
    p = indexer_problem(num_rows, 32, 128, 128, 1, context, gen, device="cuda")
    ref_scores, ref_sel, ref_cand = reference.indexer_select(*_args(p), index_topk=512, candidate_source=True)
    sel, cand = indexer_select(*_args(p), index_topk=512, candidate_source=True)
    scores, _ = indexer_scores(*_args(p))
    _check_selection(sel, ref_sel, scores, ref_scores)
    ours = candidate_entries(cand, p["positions"], 1, p["width"])
    same = (ours == ref_cand).all(-1)
    # A row's block choice may differ only where two block maxima are within rounding of each other.
    assert float(same.float().mean()) >= 0.95 and same[-1]
    later = indexer_problem(num_rows, 32, 128, 128, 1, context, gen, device="cuda", positions=p["positions"])
    ref_scores, ref_sel, _ = reference.indexer_select(*_args(later), index_topk=512, candidates=ours)
    sel, _ = indexer_select(*_args(later), index_topk=512, candidates=cand)
    scores, _ = indexer_scores(*_args(later), candidates=cand)
    _check_selection(sel, ref_sel, scores, ref_scores)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize(
    "options", [dict(asm=False), dict(block_n=64), dict(num_warps=8, num_stages=3), dict(block_n=256, num_warps=8)]
)
def test_gpu_flash_other_configs(options):
    """The launcher's options (the word-load dequantisation without PTX, other tiles) give the same picks."""
    from kernels.indexer import indexer_scores, indexer_select, select_topk

    gen = torch.Generator(device="cuda").manual_seed(5)
    p = indexer_problem(64, 32, 128, 128, 1, 32768, gen, device="cuda")
    ref_scores, ref_sel, _ = reference.indexer_select(*_args(p), index_topk=512)
    scores, _ = indexer_scores(*_args(p), **options)
    sel, _ = indexer_select(*_args(p), index_topk=512, **options)
    _check_selection(sel, ref_sel, scores, ref_scores)
    assert torch.equal(select_topk(scores, 512, atomic=False), sel)  # the prefix-sum compaction


@pytest.mark.gpu
@gpu
def test_gpu_select_topk_of_rows_wider_than_one_program():
    """A row of 2^19 + 3 columns (an engine's decode width at a 1M-token max_model_len): pieces of 65,536,
    the same picks as the reference's sort, in the mask form too, and replayed from a CUDA graph."""
    from kernels.indexer import select_topk

    gen = torch.Generator(device="cuda").manual_seed(9)
    scores = torch.randn(8, (1 << 19) + 3, generator=gen, device="cuda")
    scores[:, ::7] = -torch.inf
    scores[3, :] = -torch.inf
    scores[3, [5, 300_000, (1 << 19) + 2]] = 1.0
    ref = select_entries(scores.cpu(), 512).cuda()
    assert torch.equal(select_topk(scores, 512).long(), ref)
    ref_mask = torch.zeros_like(scores, dtype=torch.bool).scatter(-1, ref.clamp_min(0), True)
    ref_mask[3] = scores[3].isfinite()
    assert torch.equal(select_topk(scores, 512, as_mask=True).bool(), ref_mask)
    select_topk(scores, 512)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = select_topk(scores, 512)
    scores.copy_(scores.flip(1))
    graph.replay()
    assert torch.equal(out.long(), select_entries(scores.cpu(), 512).cuda())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("num_rows", [1, 64])
def test_gpu_w_scale_equals_torch_scaled_w(num_rows):
    """Compiled: the kernel's ``w * w_scale`` has the bits of torch's CUDA fp32 ``w * scale`` (Flash's
    Hi 32, di 128)."""
    import kernels.indexer as mod

    gen = torch.Generator(device="cuda").manual_seed(num_rows)
    p = indexer_problem(num_rows, 32, 128, 64, 2, 4096, gen, device="cuda")
    _scaled_args_match(mod, p, 128**-0.5 * 32**-0.5)
