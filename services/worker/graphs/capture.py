"""One CUDA graph captured from a function of persistent buffers: two warm-up runs on a side stream (Triton
compiles, cuBLAS picks its kernels), then the capture into a shared memory pool. The warm-up really runs,
so the caller fills its buffers with rows that touch only null blocks and slots first."""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

T = TypeVar("T")


def capture_graph(run: Callable[[], T], pool: Any | None) -> tuple[torch.cuda.CUDAGraph, T, Any]:
    """(graph, the outputs its replays write, the pool) for ``run``; ``pool`` None starts a new pool."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    if pool is None:
        pool = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = run()
    return graph, outputs, pool
