"""StaticBatch: the persistent buffers a decode graph reads, filled from a plan in one upload."""

from __future__ import annotations

import pytest
import torch

import services.worker.batch.static_batch as static_batch
from services.worker.batch.static_batch import StaticBatch
from services.worker.batch.step_batch import StepBatch
from tests.services.worker.runners.test_model_runner import BLOCK
from tests.services.worker.runners.test_static_decode_step import MAX_LEN, _decode_plan

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def test_fill_fills_every_int_buffer_in_one_upload(monkeypatch):
    """Every int64 buffer is a view of one arena: a step's host work is one upload of it (and one of the
    live mask), not one per buffer, and each view holds the plan's values with placeholder padding."""
    plan, runner = _decode_plan("oracle")
    uploads = []
    real = static_batch.upload_into

    def counting(buffer: torch.Tensor, host: torch.Tensor) -> None:
        uploads.append(buffer.numel())
        real(buffer, host)

    monkeypatch.setattr(static_batch, "upload_into", counting)
    rows = StaticBatch(runner.cfg, 8, MAX_LEN // BLOCK, runner.cache.layout.ring_size, torch.device("cpu"))
    rows.fill(plan)
    assert uploads == [rows.arena.numel(), 8]
    n, batch = plan.num_rows, StepBatch.from_plan(plan, "cpu")
    assert torch.equal(rows.input_ids[:n], batch.input_ids) and not rows.input_ids[n:].any()
    assert torch.equal(rows.positions[:n], batch.positions) and not rows.positions[n:].any()
    assert torch.equal(rows.block_tables[:n, : plan.block_table_width], batch.block_tables[batch.row_requests])
    assert not rows.block_tables[n:].any()
    assert torch.equal(rows.seqlens_k[n:], torch.ones(8 - n, dtype=torch.long))
    assert torch.equal(rows.live, torch.arange(8) < n)
    for ratio, buf in rows.entry_slots.items():
        want = torch.zeros(8, dtype=torch.long)
        if ratio in batch.entry_writes:
            r, s = batch.entry_writes[ratio]
            want[r] = s
        assert torch.equal(buf, want)
