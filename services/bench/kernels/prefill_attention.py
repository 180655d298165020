"""Sparse prefill attention (``kernels/prefill_attention.py``) at Flash shapes: one request's chunk of
1K–32K rows ending at 4K or 32K context, against the bf16 MMA roofline, SDPA on pre-dequantised keys
and the reference's torch ops. ``python -m services.bench.kernels.run --only prefill_attention``.

``python -m services.bench.kernels.prefill_attention``: window keys dequantised in the loop vs staged once
per layer (``stage_window``), µs per layer at 1K and 4K-row chunks of a 4K context, for a compressed
layer (entries staged, as the engine runs it) and a window-only one, with the staging apart, the
results checked ``==``, and the sum over v41-s1's layers.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads only when a benchmark runs
    import torch

CASES = ((1024, 4096), (4096, 4096), (1024, 32768), (4096, 32768), (16384, 32768), (32768, 32768))  # (chunk, context)
QUICK_CASES = ((1024, 4096), (4096, 4096), (4096, 32768))
REFERENCE_MAX_ROWS = 4096  # the reference holds every row's 640 keys in fp32: 1.3 MB per row
SDPA_MAX_ROWS = 16384  # SDPA's gathered bf16 keys: 655 KB per row
SWEEP = ((16, 1), (32, 1), (32, 3))  # (block_n, num_stages) besides the default (16, 3: no spills), at QUICK_CASES[-1]
WINDOW_CASES = ((1024, 4096), (4096, 4096))  # (chunk, context) of the staged-window comparison


def prefill_attention_problem(
    chunk: int,
    context: int,
    gen: torch.Generator,
    device: str | None = None,
    ratio: int = 2,
    block_size: int = 128,
    num_heads: int | None = None,
    head_dim: int | None = None,
) -> dict[str, Any]:
    """One request's prefill chunk, rows at positions context − chunk … context − 1, in the cache
    engine's byte layout with random bytes (as ``decode_attention_problem``).

    The state slot's ring holds the positions before the chunk (FP8 e4m3 without NaNs, e8m0 scales
    2^-12…2^-7), ``step_k`` this chunk's K rows in the same format; the request's context / ratio
    entries lie in random blocks of a pool whose blocks also hold other bytes. Row r selects
    min(top-k, visible) ascending distinct entries, one per equal stratum of its visible entries
    (−1 padded). ``num_heads`` / ``head_dim`` (default Flash's 64 × 512) shrink it for CPU tests.
    """
    import torch

    from kernels.reference import entry_slots
    from model.deepseek_v41.presets import V41_S1 as cfg
    from model.deepseek_v41.rope import rope_frequencies
    from services.bench.harness import DEVICE
    from services.worker.state.cache_engine import ring_size

    if chunk > context:
        raise ValueError(f"chunk {chunk} longer than its context {context}")
    device = device or DEVICE
    heads, hd = num_heads or cfg.num_attention_heads, head_dim or cfg.head_dim
    ring, topk, first = ring_size(cfg), cfg.index_topk, context - chunk
    row_bytes, entry_bytes = hd + hd // 32, hd // 2 + hd // 16
    epb = block_size // ratio
    width = -(-context // ratio // epb)
    rng: dict[str, Any] = dict(device=device, generator=gen)

    def fp8_rows(*shape: int) -> torch.Tensor:  # e4m3 codes without NaNs, then e8m0 scales: ring-row bytes
        codes = torch.randint(0, 126, (*shape, hd), **rng, dtype=torch.uint8)
        codes |= torch.randint(0, 2, codes.shape, **rng, dtype=torch.uint8) << 7
        return torch.cat((codes, torch.randint(115, 121, (*shape, hd // 32), **rng, dtype=torch.uint8)), -1)

    # Alignment as the cache engine's (and decode_attention_problem's): state slots 4-byte, pool blocks 16-byte.
    slots_pool = torch.zeros(2, ring * row_bytes + 68, dtype=torch.uint8, device=device)
    slots_pool[1, : ring * row_bytes] = fp8_rows(ring).flatten()
    ring_view = slots_pool[:, : ring * row_bytes].view(-1, ring, row_bytes)
    step_rows = fp8_rows(chunk)
    blocks = torch.randint(0, 256, (width + 1, epb * entry_bytes + 1024), **rng, dtype=torch.uint8)
    kv_pool = blocks[:, 512 : 512 + epb * entry_bytes].view(-1, epb, entry_bytes)
    kv_pool[..., hd // 2 :] = torch.randint(24, 56, (width + 1, epb, hd // 16), **rng, dtype=torch.uint8)
    table = torch.randperm(width, **rng) + 1  # [width] the request's blocks

    pos = torch.arange(first, context, device=device)
    visible = ((pos + 1) // ratio)[:, None]  # [R, 1]
    i = torch.arange(topk, device=device)
    lo, hi = i * visible // topk, (i + 1) * visible // topk  # disjoint strata when visible ≥ top-k
    strat = lo + (torch.rand(chunk, topk, **rng) * (hi - lo)).long()
    entries = torch.where(visible >= topk, strat, torch.where(i < visible, i, -1))
    return dict(
        q=(torch.randn(chunk, heads, hd, **rng) * 0.05).to(torch.bfloat16),
        step_k=(
            step_rows[:, :hd].contiguous().view(torch.float8_e4m3fn),
            step_rows[:, hd:].contiguous().view(torch.float8_e8m0fnu),
        ),
        ring=ring_view,
        slots=torch.ones(chunk, device=device, dtype=torch.int64),
        pos=pos,
        first=torch.full((chunk,), first, device=device, dtype=torch.int64),
        window=cfg.sliding_window,
        kv_pool=kv_pool,
        entries=entries,
        table=table,
        selected=entry_slots(entries, table.expand(chunk, width), epb),
        sink=torch.randn(heads, **rng),
        freqs=rope_frequencies(cfg, compressed=True).to(device),
        scale=hd**-0.5,
    )


def prefill_attention_args(p: dict[str, Any]) -> tuple[Any, ...]:
    return (
        p["q"],
        p["step_k"],
        p["ring"],
        p["slots"],
        p["pos"],
        p["first"],
        p["window"],
        p["kv_pool"],
        p["selected"],
        p["sink"],
        p["freqs"],
        p["scale"],
    )


def _case(chunk: int, context: int, ceil: dict[str, float], gen: torch.Generator, sweep: bool) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from kernels import reference
    from kernels.prefill_attention import sparse_prefill_attention, stage_entries, stage_window
    from services.bench.harness import _bench, _bench_replay, _row

    p = prefill_attention_problem(chunk, context, gen)
    args = prefill_attention_args(p)
    heads, hd = p["q"].shape[1], p["q"].shape[2]
    window, topk = p["window"], p["selected"].shape[1]
    valid = int((p["selected"] >= 0).sum()) + int(torch.clamp(p["pos"] + 1, max=window).sum())
    flops = 4.0 * heads * hd * valid  # QK and PV over each row's valid keys
    # Fewest bytes: q in and out (bf16), this chunk's K rows once (the windows overlap), the ring rows
    # before it, each row's selected slots, and every distinct entry the chunk selects, once.
    distinct = int(torch.unique(p["selected"][p["selected"] >= 0]).numel())
    nbytes = (
        2 * chunk * heads * hd * 2
        + (chunk + window) * (hd + hd // 32)
        + chunk * (topk * 4 + 24)
        + distinct * (hd // 2 + hd // 16)
    )
    shape = f"chunk={chunk} ctx={context} H={heads} D={hd} w={window} k={topk}"
    out = torch.empty_like(p["q"])
    ours = _bench_replay(lambda: sparse_prefill_attention(*args, out=out))
    notes, theirs = [], None
    if chunk <= SDPA_MAX_ROWS:
        # SDPA: each row's 640 keys already gathered and dequantised to bf16, no sink (a stock path's best
        # case); a row's heads as its 64 queries over one key head, so no GQA expansion of the keys.
        kv = torch.randn(chunk, 1, window + topk, hd, device=p["q"].device, dtype=torch.bfloat16, generator=gen)
        qs = p["q"].unsqueeze(1)  # [R, 1, H, D]
        try:
            theirs = _bench_replay(lambda: F.scaled_dot_product_attention(qs, kv, kv))
            notes.append("torch: SDPA on gathered bf16 keys, graph replay")
        except Exception as err:  # noqa: BLE001 - report, don't die, when SDPA refuses
            notes.append(f"SDPA failed: {type(err).__name__}")
        del kv
    else:
        notes.append(f"no torch timing above {SDPA_MAX_ROWS} rows (gathered keys too large)")
    ref_us = None
    if chunk <= REFERENCE_MAX_ROWS:
        ref_us = _bench(lambda: reference.sparse_prefill_attention(*args)) * 1e6
        notes.append(f"reference torch ops {ref_us:.0f} us")
    row = _row("sparse prefill attention", shape, ours, nbytes, flops, ceil, theirs, "; ".join(notes), peak="bf16_peak")
    row.update(
        reference_us=ref_us,
        mem_roofline_us=nbytes / ceil["bandwidth"] * 1e6,
        compute_roofline_us=flops / ceil["bf16_peak"] * 1e6,
    )
    rows = [row]
    # Entries dequantised once per step (bf16 rows, gathered per row): the kernel, and the staging apart.
    rows_of = torch.zeros_like(p["pos"])
    staged, index = stage_entries(p["kv_pool"], p["table"][None], p["entries"], rows_of)
    staged_args = (*args[:8], index, *args[9:])
    t_staged = _bench_replay(lambda: sparse_prefill_attention(*staged_args, out=out, staged=staged))
    t_stage = _bench_replay(lambda: stage_entries(p["kv_pool"], p["table"][None], p["entries"], rows_of))
    staged_row = _row(
        "sparse prefill attention [staged entries]",
        shape,
        t_staged,
        nbytes,
        flops,
        ceil,
        theirs,
        f"staging (stage_entries, torch ops) {t_stage * 1e6:.0f} us apart",
        peak="bf16_peak",
    )
    staged_row["staging_us"] = t_stage * 1e6
    rows.append(staged_row)
    # Window keys staged once for the layer too (the engine's prefill attention): the kernel, staging apart.
    window_keys = stage_window(p["step_k"], p["ring"], p["slots"], p["pos"], p["first"], window, rows_of, 1)
    t_window = _bench_replay(
        lambda: sparse_prefill_attention(*staged_args, out=out, staged=staged, staged_window=window_keys)
    )
    t_stage_window = _bench_replay(
        lambda: stage_window(p["step_k"], p["ring"], p["slots"], p["pos"], p["first"], p["window"], rows_of, 1)
    )
    window_row = _row(
        "sparse prefill attention [staged entries + window]",
        shape,
        t_window,
        nbytes,
        flops,
        ceil,
        theirs,
        f"staging (stage_window, one launch) {t_stage_window * 1e6:.0f} us apart",
        peak="bf16_peak",
    )
    window_row["staging_us"] = t_stage_window * 1e6
    rows.append(window_row)
    staged = index = window_keys = None  # freed before the sweep (the timed graphs are gone)
    if sweep:
        no_entries = (*args[:8], p["selected"][:, :0], *args[9:])
        win_flops = 4.0 * heads * hd * int(torch.clamp(p["pos"] + 1, max=window).sum())
        rows.append(
            _row(
                "sparse prefill attention [window only]",
                shape,
                _bench_replay(lambda: sparse_prefill_attention(*no_entries, out=out)),
                2 * chunk * heads * hd * 2,
                win_flops,
                ceil,
                None,
                "ratio-0 layer",
                peak="bf16_peak",
            )
        )
        for block_n, stages in SWEEP:
            label = f"block_n={block_n} num_stages={stages}"
            try:
                t = _bench_replay(
                    lambda b=block_n, s=stages: sparse_prefill_attention(*args, out=out, block_n=b, num_stages=s)
                )
            except Exception as err:  # noqa: BLE001 - a config that does not compile is skipped
                row[label] = f"failed: {type(err).__name__}"
                continue
            rows.append(
                _row(f"sparse prefill attention [{label}]", shape, t, nbytes, flops, ceil, theirs, "", peak="bf16_peak")
            )
    return rows


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, object]]:
    import torch

    rows: list[dict[str, object]] = []
    for chunk, context in QUICK_CASES if quick else CASES:
        rows += _case(chunk, context, ceil, gen, sweep=(chunk, context) == QUICK_CASES[-1])
        torch.cuda.empty_cache()
    return rows


def window_staging(
    gen: torch.Generator, cases: tuple[tuple[int, int], ...] = WINDOW_CASES, **problem: Any
) -> list[dict[str, Any]]:
    """Per case and layer kind (compressed with staged entries / window-only): µs per layer of the
    attention with window keys dequantised in the loop, with them staged (the kernel alone, the
    staging alone, both in one graph), and whether the two results are ``==``. ``problem``:
    ``prefill_attention_problem``'s size options (CPU tests)."""
    import torch

    from kernels.prefill_attention import sparse_prefill_attention, stage_entries, stage_window
    from services.bench.harness import _bench_replay

    results = []
    for chunk, context in cases:
        p = prefill_attention_problem(chunk, context, gen, **problem)
        args = prefill_attention_args(p)
        rows_of = torch.zeros_like(p["pos"])
        staged, index = stage_entries(p["kv_pool"], p["table"][None], p["entries"], rows_of)

        def stage(p=p, rows_of=rows_of):
            return stage_window(p["step_k"], p["ring"], p["slots"], p["pos"], p["first"], p["window"], rows_of, 1)

        window, out = stage(), torch.empty_like(p["q"])
        layers = {
            "compressed (staged entries)": ((*args[:8], index, *args[9:]), {"staged": staged}),
            "window only": ((*args[:8], p["selected"][:, :0], *args[9:]), {}),
        }
        for layer, (call, kwargs) in layers.items():

            def attend(staged_window, call=call, kwargs=kwargs):
                return sparse_prefill_attention(*call, **kwargs, out=out, staged_window=staged_window)

            equal = torch.equal(attend(None).clone(), attend(window))
            times = {
                name: _bench_replay(fn) * 1e6
                for name, fn in (
                    ("in_loop_us", lambda: attend(None)),
                    ("staged_us", lambda: attend(window)),
                    ("stage_window_us", stage),
                    ("staged_total_us", lambda: attend(stage())),
                )
            }
            results.append(
                dict(
                    chunk=chunk,
                    context=context,
                    layer=layer,
                    equal=equal,
                    **times,
                    speedup=times["in_loop_us"] / times["staged_total_us"],
                )
            )
        staged = index = window = None  # freed before the next case (the timed graphs are gone)
        torch.cuda.empty_cache()
    return results


def print_window_staging(results: list[dict[str, Any]], num_layers: int, num_window_only: int) -> None:
    print(
        f"{'chunk':>6} {'ctx':>6} {'layer':28} {'in-loop us':>10} {'staged us':>9} {'stage us':>8} "
        f"{'staged+stage us':>15} {'x':>5} {'==':>5}"
    )
    for r in results:
        print(
            f"{r['chunk']:6d} {r['context']:6d} {r['layer']:28} {r['in_loop_us']:10.1f} {r['staged_us']:9.1f} "
            f"{r['stage_window_us']:8.1f} {r['staged_total_us']:15.1f} {r['speedup']:5.2f} {str(r['equal']):>5}"
        )
    for chunk, context in dict.fromkeys((r["chunk"], r["context"]) for r in results):
        per = {r["layer"].split()[0]: r for r in results if (r["chunk"], r["context"]) == (chunk, context)}
        counts = {"compressed": num_layers - num_window_only, "window": num_window_only}
        loop, staged = (sum(counts[k] * per[k][key] for k in counts) / 1e3 for key in ("in_loop_us", "staged_total_us"))
        print(
            f"chunk {chunk} ctx {context}: {num_layers} layers ({num_window_only} window-only) in-loop {loop:.2f} ms, "
            f"staged window {staged:.2f} ms"
        )


def main() -> int:
    import torch

    from model.deepseek_v41.presets import V41_S1 as cfg
    from services.bench.harness import DEVICE

    if not torch.cuda.is_available():
        print("no CUDA device here: the prefill attention bench needs a GPU. Nothing was measured.", file=sys.stderr)
        return 3
    print(
        f"device: {torch.cuda.get_device_name()}; sparse prefill attention at v41-s1 shapes, window keys "
        "dequantised in the loop vs staged once per layer (stage_window); us per layer call, CUDA graph replay, "
        "L2 flushed"
    )
    results = window_staging(torch.Generator(DEVICE).manual_seed(0))
    ratios = cfg.compress_ratios[: cfg.num_hidden_layers]
    print_window_staging(results, len(ratios), ratios.count(0))
    return 0 if all(r["equal"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
