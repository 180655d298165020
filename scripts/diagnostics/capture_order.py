"""Decode graph capture: order and memory pool sharing, timed on a warm compile cache (GPU).

A v41-s1 checkpoint directory (``--model``; ``--load-format dummy`` draws the weights) through ``LLM`` with CUDA
graphs, which compiles and captures every decode size the engine's way (largest first, one shared pool). Then the
same sizes are captured again on the same static steps, four ways: largest or smallest first, into one shared pool
or a pool per graph, and the first way once more at the end (drift). One JSON line per way: the total seconds,
each size's seconds and the graph memory it took (torch's reserved bytes after, less before).

    python3 scripts/diagnostics/capture_order.py --model /tmp/v41-s1-l14 [--max-num-seqs 64]
"""

from __future__ import annotations

import argparse
import gc
import json
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="room for the extra graphs' pools")
    args = p.parse_args()
    from services import cache_dirs

    cache_dirs.setup()  # the compile caches a served engine uses, so the model's kernels are warm
    import torch

    from scheduler_rs import graph_sizes
    from services.engine import LLM
    from services.worker.graphs.capture import capture_graph

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        load_format="dummy",
        max_num_seqs=args.max_num_seqs,
        max_model_len=4096,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
    print(json.dumps({"what": "engine_built_s", "seconds": round(time.perf_counter() - t0, 1)}), flush=True)
    graphs = llm.engine.worker.runner  # DecodeStepGraphs
    sizes = sorted(graph_sizes(args.max_num_seqs))

    def capture(order: list[int], shared: bool) -> dict:
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        pool, kept, seconds = None, [], {}
        start = time.perf_counter()
        for size in order:
            t = time.perf_counter()
            step = graphs.step(size)
            step.fill_placeholders()
            with graphs.runner.invariant():
                graph, outputs, new_pool = capture_graph(step.run, pool)
            pool = new_pool if shared else None
            torch.cuda.synchronize()
            seconds[size] = round(time.perf_counter() - t, 3)
            kept.append((graph, outputs))
        total = round(time.perf_counter() - start, 3)
        graph_bytes = torch.cuda.memory_reserved() - reserved
        del kept, pool
        gc.collect()
        torch.cuda.empty_cache()
        return {"total_s": total, "graph_mib": round(graph_bytes / 2**20), "capture_s": seconds}

    ways = [("largest first", True), ("smallest first", True), ("largest first", False), ("smallest first", False)]
    for order, shared in [*ways, ways[0]]:
        result = capture(sorted(sizes, reverse=order == "largest first"), shared)
        print(json.dumps({"what": "capture", "order": order, "pool": "shared" if shared else "per graph", **result}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
