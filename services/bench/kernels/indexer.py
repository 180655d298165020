"""Indexer scoring + top-k (``kernels/indexer.py``) at decode shapes: V41 Flash (Hi 32, di 128, top-k 512)
for R rows at 4K and 32K context, ratio 2 (layers 2–19) and ratio 1 (layers 20+), and the candidate
source (layer 20: 2048 blocks of 8) and a layer inside its candidates.

Fewest bytes: each visible key once (64 B FP4 + 4 B scales), q (fp32 [Hi, di]) and w, the positions,
the row's block-table entries and the selected int32 indices; the scores' round trip between the two
kernels is not counted (a fused kernel would not need it). FLOPs: 2·Hi·di per visible key (QK) plus
Hi·3 (relu, weight, sum), against the bf16 peak (the MMAs are f16). The torch side is the model's
path: ``kernels.reference.indexer_select`` (key gather + dequantisation as ``CacheEngine.read_entries``,
``Indexer.scores_quantized``, ``candidate_mask``, ``select_entries``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ROWS = (1, 8, 64, 256)
QUICK_ROWS = (1, 64, 256)
CONTEXTS = (4096, 32768)
HEADS, DIM, TOPK, BLOCK_SIZE = 32, 128, 512, 128
CAND_BLOCKS, CAND_SIZE = 2048, 8
SWEEP: list[dict[str, Any]] = [  # launcher options tried (full runs) at SWEEP_ROWS, 32K context, ratio 1
    dict(block_n=64),
    dict(block_n=128, num_stages=1),
    dict(block_n=128, num_stages=3),
    dict(block_n=128, num_warps=8),
    dict(block_n=256, num_warps=8),
    dict(asm=False),
]
SWEEP_ROWS = (64, 256)


def indexer_bench_problem(
    num_rows: int, context: int, ratio: int, gen: torch.Generator, device: str = "cuda"
) -> dict[str, Any]:
    """Random FP4 key bytes (e8m0 scales 2^-8 … 2^-4) in the pool's layout: blocks of 128 positions
    (128 / ratio entries, 68 bytes each) amid other bytes, a shuffled block table per row, every row
    decoding at position context − 1; FP4-rounded queries."""
    import torch

    from model.deepseek_v41.quant import fake_quant_indexer

    rng: dict[str, Any] = dict(device=device, generator=gen)
    epb, key_bytes = BLOCK_SIZE // ratio, DIM // 2 + DIM // 32
    width = context // ratio
    per_row = -(-width // epb)
    num_blocks = num_rows * per_row + 1
    blocks = torch.randint(0, 256, (num_blocks, epb * key_bytes + 1024), **rng, dtype=torch.uint8)
    pool = blocks[:, 512 : 512 + epb * key_bytes].view(num_blocks, epb, key_bytes)
    pool[..., DIM // 2 :] = torch.randint(119, 124, (num_blocks, epb, DIM // 32), **rng, dtype=torch.uint8)
    tables = (torch.randperm(num_blocks - 1, **rng)[: num_rows * per_row] + 1).view(num_rows, per_row)
    return dict(
        q=fake_quant_indexer(torch.randn(num_rows, HEADS, DIM, **rng)),
        w=torch.randn(num_rows, HEADS, **rng) * (DIM * HEADS) ** -0.5,
        key_pool=pool,
        block_tables=tables.to(torch.int32),
        positions=torch.full((num_rows,), context - 1, device=device, dtype=torch.int64),
        ratio=ratio,
        width=width,
    )


def _args(p: dict[str, Any]) -> tuple[Any, Any, Any, Any, Any, int, int]:
    return p["q"], p["w"], p["key_pool"], p["block_tables"], p["positions"], p["ratio"], p["width"]


def _sweep(
    p: dict[str, Any],
    kw: dict[str, Any],
    row: dict[str, object],
    nbytes: float,
    flops: float,
    ceil: dict[str, float],
    shape: str,
    theirs: float,
) -> list[dict[str, object]]:
    """Other launcher options on one problem; the best as an extra row, every one in row["sweep"]."""
    import sys

    from kernels.indexer import indexer_select
    from services.bench.harness import _row, sweep_configs

    tried, best = sweep_configs("indexer", list(SWEEP), lambda o: indexer_select(*_args(p), **{**kw, **o}))
    row["sweep"] = tried
    print(f"  indexer sweep {shape}: {tried}", file=sys.stderr)
    if best is None:
        return []
    return [
        _row(
            "indexer ratio 1 [best of sweep]",
            shape,
            best[0],
            nbytes,
            flops,
            ceil,
            theirs,
            str(best[1]),
            peak="bf16_peak",
        )
    ]


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, object]]:
    import torch

    from kernels import reference
    from kernels.indexer import candidate_entries, indexer_scores, indexer_select, select_topk
    from services.bench.harness import _bench, _bench_replay, _row

    rows: list[dict[str, object]] = []
    cases: tuple[tuple[str, int, dict[str, bool]], ...] = (
        ("ratio 2", 2, {}),
        ("ratio 1", 1, {}),
        ("ratio 1 cand. source", 1, dict(candidate_source=True)),
        ("ratio 1 in candidates", 1, dict(candidates=True)),
    )
    for context in CONTEXTS:
        for num_rows in QUICK_ROWS if quick else ROWS:
            for label, ratio, extra in cases:
                p = indexer_bench_problem(num_rows, context, ratio, gen)
                width = p["width"]
                kw: dict[str, Any] = dict(index_topk=TOPK)
                ref_kw: dict[str, Any] = dict(index_topk=TOPK)
                if extra.get("candidate_source"):
                    kw["candidate_source"] = ref_kw["candidate_source"] = True
                if extra.get("candidates"):
                    _, cand = indexer_select(*_args(p), index_topk=TOPK, candidate_source=True)
                    assert cand is not None
                    kw["candidates"] = cand
                    ref_kw["candidates"] = candidate_entries(cand, p["positions"], 1, width)
                visible = int(p["positions"].max()) // ratio + 1
                nbytes = num_rows * (
                    visible * (DIM // 2 + DIM // 32)
                    + HEADS * DIM * 4
                    + HEADS * 4
                    + 8
                    + (visible // (BLOCK_SIZE // ratio) + 1) * 4
                    + TOPK * 4
                )
                flops = num_rows * visible * (2.0 * HEADS * DIM + 3 * HEADS)
                # The lambdas take p and scores as defaults: the iteration ends by deleting both.
                ours = _bench_replay(lambda p=p: indexer_select(*_args(p), **kw))
                # Eager: the reference's FP4 decode builds its table on the host (not capturable).
                theirs = _bench(lambda p=p: reference.indexer_select(*_args(p), **ref_kw))
                note = "torch: the model's functions (reference.indexer_select), eager"
                shape = f"R={num_rows} ctx={context} W={width} Hi={HEADS} di={DIM} k={TOPK}"
                row = _row(f"indexer {label}", shape, ours, nbytes, flops, ceil, theirs, note, peak="bf16_peak")
                scores, _ = indexer_scores(*_args(p), candidates=kw.get("candidates"))
                row["score_kernel_us"] = (
                    _bench_replay(lambda p=p: indexer_scores(*_args(p), candidates=kw.get("candidates"))) * 1e6
                )
                row["select_kernel_us"] = _bench_replay(lambda scores=scores: select_topk(scores, TOPK)) * 1e6
                rows.append(row)
                if not quick and label == "ratio 1" and context == CONTEXTS[-1] and num_rows in SWEEP_ROWS:
                    rows += _sweep(p, kw, row, nbytes, flops, ceil, shape, theirs)
                del p, scores
                torch.cuda.empty_cache()
    return rows
