"""The persistent input buffers of a static decode step of G rows: what a CUDA graph reads.

``fill(plan)`` (host work allowed) fills them from a decode StepPlan of n ≤ G rows: one row per
request, or with speculative decoding 1 + the drafts verified (a request's rows contiguous, at
consecutive positions, as in a StepBatch), and pads rows n … G−1 with placeholder rows, each its own
request. Request-level arrays are sized G too (a plan has at most as many requests as rows), so the
shapes never depend on how rows split into requests. Placeholder rows sit at
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
from services.worker.batch.step_batch import PendingInputs, StepBatch, apply_pending, check_ring_slots, pending_rows


class StaticBatch:
    def __init__(
        self,
        cfg: ModelConfig,
        num_rows: int,
        max_blocks_per_request: int,
        ring_size: int,
        device: torch.device,
        block_size: int | None = None,
    ) -> None:
        self.num_rows = num_rows  # G
        self.max_blocks = max_blocks_per_request  # B, the block tables' width
        self.ring_size = ring_size  # the cache's ring: plans' ring slots must be position mod it
        self.block_size = block_size  # the cache's block: async fix-ups after drafts recompute entry slots
        self.device = device

        ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids})
        g, b = num_rows, max_blocks_per_request
        # Every int64 buffer is a view of one arena, so ``fill`` fills one host tensor of the same
        # layout and uploads it in one copy (one pin, one enqueue) instead of one per buffer.
        sizes = {
            "input_ids": g,
            "positions": g,
            "state_slots": g,
            "row_requests": g,
            "ring_slots": g,
            "block_tables": g * b,
            "query_start": g + 1,
            "first": g,
            "seqlens_k": g,
            "request_slots": g,
            "row_first": g,
            "row_seqlens_k": g,
            **{f"entry_slots_{r}": g for r in ratios},
        }
        self._offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in sizes.items():
            self._offsets[name] = (start, start + size)
            start += size
        self.arena = torch.zeros(start, dtype=torch.long, device=device)  # every buffer below, packed

        def view(name: str) -> torch.Tensor:
            lo, hi = self._offsets[name]
            return self.arena[lo:hi]

        self.input_ids = view("input_ids")  # [G]
        self.positions = view("positions")  # [G]
        self.state_slots = view("state_slots")  # [G] the row's request's slot; 0 for placeholder rows
        self.row_requests = view("row_requests")  # [G] the row's request (real ones first, then one per placeholder)
        self.ring_slots = view("ring_slots")  # [G] position mod ring size
        self.block_tables = view("block_tables").view(g, b)  # [G, B] padded with the null block 0
        self.live = torch.zeros(g, dtype=torch.bool, device=device)  # [G] real rows: a prefix (count towards experts)
        # ratio → [G] pool slot of the entry the row's group closes; 0 (the null block) for no entry.
        self.entry_slots = {r: view(f"entry_slots_{r}") for r in ratios}
        # Per request (G entries; those past the real and placeholder requests are never indexed):
        self.query_start = view("query_start")  # [G+1] the request's first row
        self.first = view("first")  # [G] the request's first position this step (positions below are cached)
        self.seqlens_k = view("seqlens_k")  # [G] its last position + 1
        self.request_slots = view("request_slots")  # [G] its state slot
        # Per row, gathered from the request's (kept so the graph reads them without an index op):
        self.row_first = view("row_first")  # [G] first[row_requests]
        self.row_seqlens_k = view("row_seqlens_k")  # [G] seqlens_k[row_requests]
        self.fill_placeholders()
        self.num_live = 0  # host copy of the real rows, for trimming

    @staticmethod
    def fits(plan: StepPlan) -> bool:
        """A decode plan with rows (1 + the drafts verified per request), a graph size chosen."""
        return not plan.is_prefill and not plan.is_placeholder and plan.graph_size is not None and plan.num_rows > 0

    def fill(self, plan: StepPlan, pending: PendingInputs | None = None) -> None:
        """Fill the buffers from ``plan`` (host work; before a replay). Rows past the plan's are placeholders."""
        n, g = plan.num_rows, self.num_rows
        if not self.fits(plan) or n > g:
            raise ValueError(f"not a decode plan of ≤ {g} rows: {plan}")
        if plan.block_table_width > self.max_blocks:
            raise ValueError(f"block tables of {plan.block_table_width} > {self.max_blocks} blocks per request")
        if pending is None and any(plan.inputs_pending.tolist()):
            raise ValueError("the plan's inputs wait on a step in flight (async scheduling): pass them")
        check_ring_slots(plan, self.ring_size)
        batch = StepBatch.from_plan(plan, "cpu")
        if pending is not None and pending.drafts is not None:
            # After a step with drafts (async scheduling): the seqlen fix-up, on the host batch (the drafts
            # and rejected counts are host lists); only the first rows' tokens stay on the device (below).
            if self.block_size is None:
                raise ValueError("pending inputs with drafts need the cache's block size for the seqlen fix-up")
            batch.fix_positions(plan, pending, self.ring_size, self.block_size)
        if int(batch.positions.min()) < 1:  # the compressor reads position p − 1's partial row
            raise ValueError("a decode row at position 0 (a request without a prompt)")

        def padded(x: torch.Tensor, fill: int = 0) -> torch.Tensor:
            return torch.cat((x, x.new_full((g - len(x), *x.shape[1:]), fill)))

        m = plan.num_requests
        placeholders = torch.arange(m, m + g - n)  # placeholder row n + j is request m + j
        row_requests = torch.cat((batch.row_requests, placeholders))
        query_start = torch.cat((batch.query_start, torch.arange(n + 1, g + 1), torch.full((n - m,), g)))
        first, seqlens_k = padded(batch.first), padded(batch.seqlens_k, 1)
        host = torch.zeros_like(self.arena, device="cpu")

        def fill(name: str, values: torch.Tensor) -> None:
            lo, hi = self._offsets[name]
            host[lo:hi] = values.reshape(-1)

        fill("input_ids", padded(batch.input_ids))
        fill("positions", padded(batch.positions))
        fill("state_slots", padded(batch.state_slots[batch.row_requests]))
        fill("row_requests", row_requests)
        fill("ring_slots", padded(batch.ring_slots))
        fill("query_start", query_start)
        fill("first", first)
        fill("seqlens_k", seqlens_k)
        fill("request_slots", padded(batch.state_slots))
        fill("row_first", first[row_requests])
        fill("row_seqlens_k", seqlens_k[row_requests])
        tables = host[slice(*self._offsets["block_tables"])].view(g, self.max_blocks)  # zeros: the null block
        tables[:n, : plan.block_table_width] = batch.block_tables[batch.row_requests]
        for ratio in self.entry_slots:
            rows, slots = batch.entry_writes.get(ratio, (torch.zeros(0, dtype=torch.long),) * 2)
            host[self._offsets[f"entry_slots_{ratio}"][0] + rows] = slots
        # Enqueued, not synchronised: the step in flight (async scheduling) may still be reading these
        # buffers, and the copies run after it in stream order.
        upload_into(self.arena, host)
        upload_into(self.live, torch.arange(g) < n)
        if pending is not None:  # on the device, from the step in flight's tokens (never read back)
            where = pending_rows(plan, pending)
            if where is not None:
                apply_pending(self.input_ids, *where, pending.token_ids)
        self.num_live = n

    def fill_placeholders(self) -> None:
        """Every row a placeholder (graph warm-up and capture): the step then touches only block 0 / slot 0."""
        for buf in (
            self.input_ids,
            self.positions,
            self.state_slots,
            self.ring_slots,
            self.block_tables,
            self.first,
            self.request_slots,
            self.row_first,
            *self.entry_slots.values(),
        ):
            buf.zero_()
        for buf in (self.seqlens_k, self.row_seqlens_k):
            buf.fill_(1)
        self.row_requests.copy_(torch.arange(self.num_rows))
        self.query_start.copy_(torch.arange(self.num_rows + 1))
        self.live.zero_()
        self.num_live = 0
