"""Fused compressor kernel (``kernels/compressor.py``) at the Flash shapes: `--only compressor`.

A decode step of E requests, one row each, every row closing a group (so E entries): ratio 2 (KV
sources 2, 8, 14) takes member p−1 from the state slot's fp32 partial rows and writes the row's own
(value, gate) there; ratio 1 (source 20) takes its projected row. The projections are inputs (they
stay outside the kernel), so the bytes are the fewest the rest must move: the step's fp32 values
and gates (ratio 1: the bf16 projected rows), the partial rows read, ``wk`` and the norm weights,
the entries and keys written (288 + 68 bytes each) and the partial rows written. FLOPs: the wk
product, 2 · E · 128 · 512, against the bf16 peak.

The torch time is ``TorchAttention.write_groups`` on the same inputs, eager (its boolean-mask indexing
syncs): its ``Compressor.project`` returns the given values and gates (ratio 2); ratio 1's
projection becomes an identity [512, 512] bf16 GEMM on the projected rows (a few µs at E = 2048,
counted against torch). The cache keeps one source's
layout (blocks of that source only, 3 layers of rings per state slot) to fit 2,048 state slots.
"""

from __future__ import annotations

import copy
import dataclasses
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

ENTRIES = (1, 64, 256, 2048)
QUICK_ENTRIES = (1, 256, 2048)
# Launcher options also timed (full run only) at these E: the sum-of-squares pass's width (default 64;
# 128 compiles at 255 registers, 32 is the second pass's width) and 4 warps (spills offline).
SWEEP = [dict(sum_chunk=32), dict(sum_chunk=128), dict(num_warps=4)]
SWEEP_ENTRIES = (64, 2048)
BLOCK_SIZE = 128


def flash_source_config(ratio: int) -> Any:
    """Flash's shapes with one KV source, layer 2, of ``ratio`` (3 layers of rings per state slot)."""
    from model.deepseek_v41.presets import V41_S1

    return dataclasses.replace(
        V41_S1,
        num_hidden_layers=3,
        compress_ratios=(0, 0, ratio),
        kv_source_layer_ids=(2,),
        index_source_layer_ids=(2,),
        candidate_source_layer_id=2,
        engram_layer_ids=(),
        engram_num_embeddings=(),
    )


def compressor_problem(
    num_entries: int, ratio: int, gen: torch.Generator, device: str = "cuda", dtype: Any = None
) -> dict[str, Any]:
    """E decode requests at random positions (< 64K; odd for ratio 2), each with its own state slot and
    block; the inputs of ``compress`` and of ``TorchAttention.write_groups`` on two identical caches."""
    import torch
    from torch import nn

    from model.deepseek_v41.compressor import Compressor
    from model.deepseek_v41.indexer import Indexer
    from model.deepseek_v41.rope import rope_frequencies
    from services.worker.batch.step_batch import StepBatch
    from services.worker.state.cache_engine import CacheEngine, ring_size

    dtype = dtype or torch.bfloat16
    cfg = flash_source_config(ratio)
    hd, di, n = cfg.head_dim, cfg.index_head_dim, num_entries
    rng: dict[str, Any] = dict(device=device, generator=gen)
    cache = CacheEngine(cfg, BLOCK_SIZE, num_blocks=n + 1, num_state_slots=n + 1, ring=ring_size(cfg), device=device)
    epb = cache.layout.source(2).entries_per_block
    pos = torch.randint(0, 32768, (n,), **rng) * 2 + (1 if ratio == 2 else 0)
    if ratio == 2:
        cache.partial(2).copy_(torch.randn(cache.partial(2).shape, **rng))
    idx = torch.arange(n, device=device)
    batch = StepBatch(
        request_ids=[f"r{i}" for i in range(n)],
        input_ids=torch.zeros_like(pos),
        positions=pos,
        row_requests=idx,
        ring_slots=pos % cache.layout.ring_size,
        query_start=torch.arange(n + 1, device=device),
        first=pos.clone(),
        seqlens_k=pos + 1,
        state_slots=idx + 1,
        block_tables=(idx + 1)[:, None],
        sample_rows=idx,
        entry_writes={ratio: (idx, (idx + 1) * epb + (pos // ratio) % epb)},
    )
    comp = Compressor(cfg, ratio).to(device)
    indexer = Indexer(cfg, owns_keys=True).to(device)
    with torch.no_grad():
        comp.norm.weight.copy_(1 + 0.2 * torch.randn(hd, **rng))
        indexer.wk.weight.copy_(torch.randn(di, hd, **rng) / hd**0.5)
        indexer.k_norm.weight.copy_(1 + 0.2 * torch.randn(di, **rng))
    indexer.to(dtype)
    p: dict[str, Any] = dict(cache=cache, ref_cache=copy.deepcopy(cache), batch=batch, ratio=ratio, dtype=dtype)
    weights = dict(
        norm_weight=comp.norm.weight.detach(),
        wk=indexer.wk.weight.detach(),
        k_norm_weight=indexer.k_norm.weight.detach(),
        freqs=rope_frequencies(cfg, compressed=True).to(device),
        eps=cfg.rms_norm_eps,
    )
    if ratio == 2:
        values, gates = torch.randn(n, hd, **rng), torch.randn(n, hd, **rng)
        comp.project = lambda x: (values, gates)  # the projection stays outside: given
        p.update(values=values, gates=gates, x=torch.zeros(n, 1, device=device, dtype=dtype))
    else:
        projected = torch.randn(n, hd, **rng).to(dtype)
        comp.wkv = nn.Linear(hd, hd, bias=False).to(device)
        with torch.no_grad():
            comp.wkv.weight.copy_(torch.eye(hd, device=device))  # _compress projects x[rows]: an exact copy
        p.update(projected=projected, x=projected)
    p["attn"] = SimpleNamespace(layer=2, ratio=ratio, compressor=comp, indexer=indexer, freqs=weights["freqs"])
    p["weights"] = weights
    return p


def run_kernel(p: dict[str, Any], compress: Any = None, **kwargs: Any) -> None:
    """``compress`` defaults to the compiled kernel's launcher (tests pass the interpreted one)."""
    if compress is None:
        from kernels.compressor import compress

    rows, slots = p["batch"].entry_writes[p["ratio"]]
    kv_pool, key_pool = p["cache"].entries(2)
    inputs = (
        dict(projected=p["projected"])
        if p["ratio"] == 1
        else dict(values=p["values"], gates=p["gates"], partial=p["cache"].partial(2), dtype=p["dtype"])
    )
    compress(p["batch"], rows, slots, kv_pool, key_pool, **p["weights"], **inputs, **kwargs)


def run_torch(p: dict[str, Any]) -> None:
    import torch

    from services.worker.attention.torch_backend import TorchAttention

    with torch.no_grad():
        TorchAttention(p["ref_cache"], p["batch"]).write_groups(p["attn"], p["x"])


def problem_bytes(num_entries: int, ratio: int, hd: int = 512, di: int = 128) -> float:
    """Fewest bytes: inputs read once, wk and the norm weights, entries, keys and partial rows written."""
    meta = num_entries * 8 * 8  # rows, slots, positions, request, first, query start, seqlen, state slot
    weights = di * hd * 2 + hd * 4 + di * 2 + 32 * 4
    written = num_entries * (hd // 2 + hd // 16 + di // 2 + di // 32)
    if ratio == 1:
        return num_entries * hd * 2 + meta + weights + written
    rows = num_entries * 2 * hd * 4  # the step's (value, gate) rows; the same again from the partial rows
    return 2 * rows + meta + weights + written + rows  # + the partial rows written


def bench(ceil: dict[str, float], quick: bool, gen: torch.Generator) -> list[dict[str, object]]:
    from services.bench.harness import _bench, _bench_replay, _row

    rows = []
    for ratio in (2, 1):
        for e in QUICK_ENTRIES if quick else ENTRIES:
            p = compressor_problem(e, ratio, gen)
            ours = _bench_replay(lambda: run_kernel(p))
            # Eager: the torch path's boolean-mask indexing (the partial rows' tail) syncs, so it cannot be a graph.
            theirs, note = (
                _bench(lambda: run_torch(p)),
                "torch: TorchAttention.write_groups after the projection, eager",
            )
            flops = 2.0 * e * 128 * 512
            name, shape = f"compressor ratio {ratio} (pool/norm/rope/fp4 + keys)", f"E={e} hd=512 di=128 bf16"
            rows.append(_row(name, shape, ours, problem_bytes(e, ratio), flops, ceil, theirs, note, peak="bf16_peak"))
            if quick or e not in SWEEP_ENTRIES:
                continue
            for options in SWEEP:
                try:
                    t = _bench_replay(lambda o=options: run_kernel(p, **o))
                except Exception as err:  # noqa: BLE001 - a configuration that does not compile is skipped
                    print(f"  compressor {options} failed: {type(err).__name__}: {str(err)[:120]}", file=sys.stderr)
                    continue
                rows.append(
                    _row(
                        f"{name} {options}",
                        shape,
                        t,
                        problem_bytes(e, ratio),
                        flops,
                        ceil,
                        theirs,
                        note,
                        peak="bf16_peak",
                    )
                )
    return rows
