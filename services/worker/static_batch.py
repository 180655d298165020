"""The persistent input buffers of a static decode step of G rows: what a CUDA graph reads.

``prepare(plan)`` (host work allowed) fills them from a decode-only StepPlan (nextn = 0: one row per
request, row i = request i) and pads rows n … G−1 with placeholder rows. Placeholder rows sit at
position 0 of state slot 0 with an all-zero block table: every write they do lands in the null state
slot 0 or the null block 0 (id 0 is never handed out by either pool: see
scheduler_rs/src/block_manager.rs), and they count towards no expert. A real row that closes no
compressed group writes its would-be entry to pool slot 0 (block 0) too, so every row writes every
layer and no write depends on a row's data.
"""

from __future__ import annotations

import torch

from kernels.device import upload_into
from model.deepseek_v41.config import ModelConfig
from scheduler_rs import StepPlan
from services.worker.step_batch import PendingInputs, StepBatch, apply_pending, check_ring_slots, pending_rows


class StaticBatch:
    def __init__(self, cfg: ModelConfig, num_rows: int, max_blocks_per_request: int, ring_size: int,
                 device: torch.device) -> None:
        self.num_rows = num_rows  # G
        self.max_blocks = max_blocks_per_request  # B, the block tables' width
        self.ring_size = ring_size  # the cache's ring: plans' ring slots must be position mod it
        self.device = device

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.input_ids = zeros(num_rows)  # [G]
        self.positions = zeros(num_rows)  # [G]
        self.state_slots = zeros(num_rows)  # [G] the row's request's slot; 0 for placeholder rows
        self.ring_slots = zeros(num_rows)  # [G] position mod ring size
        self.block_tables = zeros(num_rows, max_blocks_per_request)  # [G, B] padded with the null block 0
        self.live = zeros(num_rows, dtype=torch.bool)  # [G] real rows: a prefix (count towards experts)
        ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids})
        # ratio → [G] pool slot of the entry the row's group closes; 0 (the null block) for no entry.
        self.entry_slots = {r: zeros(num_rows) for r in ratios}
        self.rows = torch.arange(num_rows, device=device)  # [G]: row i is request i
        self.query_start = torch.arange(num_rows + 1, device=device)  # [G+1]
        self.num_live = 0  # host copy of the real rows, for trimming

    @staticmethod
    def fits(plan: StepPlan) -> bool:
        """A decode-only plan with rows: one row per request (no drafts), a graph size chosen."""
        return (not plan.is_prefill and not plan.is_placeholder and plan.graph_size is not None
                and plan.num_rows > 0 and plan.num_rows == plan.num_requests)

    def prepare(self, plan: StepPlan, pending: PendingInputs | None = None) -> None:
        """Fill the buffers from ``plan`` (host work; before a replay). Rows past the plan's are placeholders."""
        n, g = plan.num_rows, self.num_rows
        if not self.fits(plan) or n > g:
            raise ValueError(f"not a decode-only plan of ≤ {g} rows (one per request): {plan}")
        if plan.block_table_width > self.max_blocks:
            raise ValueError(f"block tables of {plan.block_table_width} > {self.max_blocks} blocks per request")
        if pending is None and any(plan.inputs_pending.tolist()):
            raise ValueError("the plan's inputs wait on a step in flight (async scheduling): pass them")
        check_ring_slots(plan, self.ring_size)
        batch = StepBatch.from_plan(plan, "cpu")
        if int(batch.positions.min()) < 1:  # the compressor reads position p − 1's partial row
            raise ValueError("a decode row at position 0 (a request without a prompt)")

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat((x, x.new_zeros(g - n, *x.shape[1:])))

        # Enqueued, not synchronised: the step in flight (async scheduling) may still be reading these
        # buffers, and the copies run after it in stream order.
        upload_into(self.input_ids, padded(batch.input_ids))
        upload_into(self.positions, padded(batch.positions))
        upload_into(self.state_slots, padded(batch.state_slots))
        upload_into(self.ring_slots, padded(batch.ring_slots))
        tables = torch.zeros(g, self.max_blocks, dtype=torch.long)
        tables[:n, : plan.block_table_width] = batch.block_tables
        upload_into(self.block_tables, tables)
        upload_into(self.live, torch.arange(g) < n)
        for ratio, buf in self.entry_slots.items():
            rows, slots = batch.entry_writes.get(ratio, (torch.zeros(0, dtype=torch.long),) * 2)
            host = torch.zeros(g, dtype=torch.long)
            host[rows] = slots
            upload_into(buf, host)
        if pending is not None:  # on the device, from the step in flight's tokens (never read back)
            where = pending_rows(plan, pending)
            if where is not None:
                apply_pending(self.input_ids, *where, pending.token_ids)
        self.num_live = n

    def prepare_placeholders(self) -> None:
        """Every row a placeholder (graph warm-up and capture): the step then touches only block 0 / slot 0."""
        for buf in (self.input_ids, self.positions, self.state_slots, self.ring_slots, self.block_tables,
                    *self.entry_slots.values()):
            buf.zero_()
        self.live.zero_()
        self.num_live = 0
