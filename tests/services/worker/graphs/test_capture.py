"""capture_graph: the warm-up runs twice, the capture records the run, a replay reads refilled buffers."""

from __future__ import annotations

import pytest
import torch

from services.worker.graphs.capture import capture_graph


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_replay_reads_the_buffers_as_they_are_then():
    x = torch.zeros(4, device="cuda")
    calls = []

    def run() -> torch.Tensor:
        calls.append(1)
        return x * 2 + 1

    graph, out, pool = capture_graph(run, None)
    assert len(calls) == 3 and pool is not None  # two warm-up runs, then the captured one
    x.copy_(torch.arange(4.0, device="cuda"))
    graph.replay()
    assert out.tolist() == [1.0, 3.0, 5.0, 7.0]
    again, out2, pool2 = capture_graph(run, pool)
    assert pool2 is pool
    x.fill_(-1.0)
    again.replay()
    assert out2.tolist() == [-1.0] * 4
