"""`shinkai bench kernels` rows of the sparse decode attention (``--only attention``): a Flash-shaped
problem in the cache engine's byte layout, timed against the reference's torch ops and SDPA, with an
optional config sweep. ``decode_attention_problem`` / ``decode_attention_args`` also serve the GPU tests."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from services.bench import harness as timing  # read at call time: tests replace its timers and device

if TYPE_CHECKING:
    import torch

# Flash shapes: 64 heads × 512, window 128 (ring 134), top-k 512 FP4 entries; these contexts.
ATTN_CONTEXTS = (4096, 32768)
ATTN_SWEEP = [  # (block_h, block_n, num_warps, num_stages); tried at ATTN_SWEEP_ROWS, 32K context
    (64, 64, 8, 2),
    (64, 64, 8, 3),
    (64, 32, 8, 3),
    (64, 32, 8, 4),
]
ATTN_SWEEP_ROWS = (64, 256)


def decode_attention_problem(
    num_rows: int, context: int, gen: torch.Generator, device: str | None = None, ratio: int = 2, block_size: int = 128
) -> dict[str, Any]:
    """A Flash-shaped decode attention problem in the cache engine's byte layout, random bytes.

    Each row has its own state slot (ring of 134 FP8 positions: e4m3 codes without NaNs, e8m0
    scales 2^-12…2^-7) and its own ``context / ratio`` entries spread over random blocks of a pool
    whose blocks also hold other bytes (as the real pool holds other sources); its top-k (512) are
    drawn uniformly among them. Every row decodes at position context − 1.
    """
    import torch

    from kernels.reference import entry_slots
    from model.deepseek_v41.presets import V41_S1 as cfg
    from model.deepseek_v41.rope import rope_frequencies
    from services.worker.state.cache_engine import ring_size

    device = device or timing.DEVICE
    hd, ring = cfg.head_dim, ring_size(cfg)
    row_bytes, entry_bytes = hd + hd // 32, hd // 2 + hd // 16
    epb = block_size // ratio
    width = -(-context // ratio // epb)
    num_blocks = num_rows * width + 1
    rng: dict[str, Any] = dict(device=device, generator=gen)
    codes = torch.randint(0, 126, (num_rows, ring, hd), **rng, dtype=torch.uint8)  # |x| ≤ 448, no NaN
    codes |= torch.randint(0, 2, codes.shape, **rng, dtype=torch.uint8) << 7
    scales = torch.randint(115, 121, (num_rows, ring, hd // 32), **rng, dtype=torch.uint8)
    # Alignment as the cache engine's: state slots 4-byte (Flash's 2,916,132 B), pool blocks 16-byte.
    slots_pool = torch.zeros(num_rows + 1, ring * row_bytes + 68, dtype=torch.uint8, device=device)
    slots_pool[1:, : ring * row_bytes] = torch.cat((codes, scales), -1).flatten(1)
    ring_view = slots_pool[:, : ring * row_bytes].view(-1, ring, row_bytes)
    blocks = torch.randint(0, 256, (num_blocks, epb * entry_bytes + 1024), **rng, dtype=torch.uint8)
    kv_pool = blocks[:, 512 : 512 + epb * entry_bytes].view(-1, epb, entry_bytes)
    kv_pool[..., hd // 2 :] = torch.randint(24, 56, (num_blocks, epb, hd // 16), **rng, dtype=torch.uint8)
    tables = (torch.randperm(num_blocks - 1, **rng)[: num_rows * width] + 1).view(num_rows, width)
    entries = torch.rand(num_rows, context // ratio, **rng).argsort(-1)[:, : cfg.index_topk].sort(-1).values
    return dict(
        q=(torch.randn(num_rows, cfg.num_attention_heads, hd, **rng) * 0.05).to(torch.bfloat16),
        ring=ring_view,
        slots=torch.arange(1, num_rows + 1, device=device),
        pos=torch.full((num_rows,), context - 1, device=device, dtype=torch.int64),
        window=cfg.sliding_window,
        kv_pool=kv_pool,
        selected=entry_slots(entries, tables, epb),
        sink=torch.randn(cfg.num_attention_heads, **rng),
        freqs=rope_frequencies(cfg, compressed=True).to(device),
        scale=hd**-0.5,
    )


def decode_attention_args(p: dict[str, Any]) -> tuple[Any, ...]:
    return (
        p["q"],
        p["ring"],
        p["slots"],
        p["pos"],
        p["window"],
        p["kv_pool"],
        p["selected"],
        p["sink"],
        p["freqs"],
        p["scale"],
    )


def bench_decode_attention(
    num_rows: int, context: int, ceil: dict[str, float], sweep: bool, gen: torch.Generator
) -> list[dict[str, object]]:
    """Sparse decode attention at one batch and context, against the reference's torch ops (eager: its
    FP4 decode builds a table on the host) and SDPA on keys dequantised to bf16 beforehand."""
    import torch
    import torch.nn.functional as F

    from kernels import reference
    from kernels.decode_attention import sparse_decode_attention

    p = decode_attention_problem(num_rows, context, gen)
    args = decode_attention_args(p)
    heads, hd = p["q"].shape[1], p["q"].shape[2]
    window, topk = p["window"], p["selected"].shape[1]
    keys = window + topk
    out = torch.empty_like(p["q"])
    # Fewest bytes: q in, out back (bf16), the window's FP8 rows + scales, the selected FP4 entries +
    # scales and their int32 slots, per row's position and state slot.
    nbytes = num_rows * (2 * heads * hd * 2 + window * (hd + hd // 32) + topk * (hd // 2 + hd // 16 + 4) + 16)
    flops = 4.0 * num_rows * heads * hd * keys  # QK and PV, 2 FLOP per multiply-add each
    shape = f"R={num_rows} ctx={context} H={heads} D={hd} w={window} k={topk}"
    ours = timing._bench_replay(lambda: sparse_decode_attention(*args, out=out))
    theirs_ref = timing._bench(lambda: reference.sparse_decode_attention(*args))
    # SDPA: keys already dequantised to bf16 (what a stock path would hold), boolean mask, no sink.
    kv = torch.randn(num_rows, 1, keys, hd, device=timing.DEVICE, dtype=torch.bfloat16, generator=gen)
    mask = torch.ones(num_rows, 1, 1, keys, device=timing.DEVICE, dtype=torch.bool)
    qs = p["q"].unsqueeze(2)
    try:
        theirs = timing._bench_replay(
            lambda: F.scaled_dot_product_attention(qs, kv, kv, attn_mask=mask, enable_gqa=True)
        )
        torch_note = f"torch: SDPA on bf16 keys, graph replay; the reference's torch ops: {theirs_ref * 1e6:.0f} us"
    except Exception as err:  # noqa: BLE001 - report, don't die, when SDPA refuses
        theirs, torch_note = theirs_ref, f"torch: the reference's ops (SDPA failed: {type(err).__name__})"
    row = timing._row("sparse decode attention", shape, ours, nbytes, flops, ceil, theirs, torch_note, peak="bf16_peak")
    mem_floor = nbytes / ceil["bandwidth"]
    row.update(
        mem_roofline_us=mem_floor * 1e6,
        pct_mem_roofline=100 * mem_floor / ours,
        compute_roofline_us=flops / ceil["bf16_peak"] * 1e6,
        reference_us=theirs_ref * 1e6,
        graph_us=timing._bench_graph(lambda: sparse_decode_attention(*args, out=out)) * 1e6,
    )
    row["graph_tb_s"] = nbytes / row["graph_us"] / 1e6
    rows = [row]
    if sweep and num_rows in ATTN_SWEEP_ROWS and context == ATTN_CONTEXTS[-1]:
        configs = [
            dict(block_h=block_h, block_n=block_n, num_warps=warps, num_stages=stages)
            for block_h, block_n, warps, stages in ATTN_SWEEP
        ]
        tried, best = timing.sweep_configs("", configs, lambda c: sparse_decode_attention(*args, out=out, **c))
        # Where the time goes: the window alone (128 FP8 keys), the entries alone (512 FP4 keys).
        alone = {"window only": (*args[:6], p["selected"][:, :0], *args[7:]), "entries only": (*args[:4], 0, *args[5:])}
        for label, variant in alone.items():
            try:
                row[f"{label} us"] = timing._bench_replay(lambda a=variant: sparse_decode_attention(*a, out=out)) * 1e6
            except Exception as err:  # noqa: BLE001
                print(f"  {label} failed: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
        print(
            f"  R={num_rows}: sweep {tried}; window only {row.get('window only us')}, "
            f"entries only {row.get('entries only us')} us",
            file=sys.stderr,
        )
        row["sweep"] = tried
        if best is not None:
            rows.append(
                timing._row(
                    "sparse decode attention [best of sweep]",
                    shape,
                    best[0],
                    nbytes,
                    flops,
                    ceil,
                    theirs,
                    str(best[1]),
                    peak="bf16_peak",
                )
            )
    return rows
