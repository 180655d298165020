"""The placeholder step's batch: one fake row, so an idle rank still runs the model and joins every
collective of the step (walkthrough Pass 1 Thread 4, "The idle rank").

The row is token 0 at position 0 of a request on block 0 and state slot 0, the pools' null entries that
the scheduler never hands out: what the fake row writes there is never read by a real request (reads are
bounded by each request's own positions, blocks and slot). It samples nothing and writes no compressed
entry; its MoE pairs are dropped before dispatch (``ExpertParallel.placeholder``), so it routes to no expert.
"""

from __future__ import annotations

import torch

from services.worker.batch.step_batch import StepBatch


def placeholder_batch(entry_ratios: list[int], device: torch.device | str) -> StepBatch:
    def longs(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=device)

    empty = longs()
    return StepBatch(
        request_ids=["placeholder"],
        input_ids=longs(0),
        positions=longs(0),
        row_requests=longs(0),
        ring_slots=longs(0),
        query_start=longs(0, 1),
        first=longs(0),
        seqlens_k=longs(1),
        state_slots=longs(0),
        block_tables=longs(0).view(1, 1),
        sample_rows=empty,
        entry_writes={r: (empty, empty) for r in entry_ratios},
        decode_only=True,
        max_seqlen_k=1,
    )
