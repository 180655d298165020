"""A StepPlan as the tensors the cached forward indexes with (one row per planned token).

Rows of request i are contiguous, rows ``query_start[i] … query_start[i+1]−1``, at consecutive
positions ``first[i] … seqlens_k[i]−1``; positions below ``first[i]`` are cached (rings, blocks,
partial groups, Engram history), positions from it on are this step's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.device import upload
from scheduler_rs import StepPlan


def _long(a) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(a, np.int32).astype(np.int64))


@dataclass
class PendingInputs:
    """Async scheduling: the step in flight's request ids and the last token each sampled (−1 = none).
    With speculative decoding also each request's new drafts and how many of its rows that step did not
    accept: the scheduler planned the next step counting every row as accepted, so the next step's rows
    of that request sit that many positions too far, and its draft rows hold stale drafts."""

    request_ids: list[str]
    token_ids: torch.Tensor  # [N prev] long
    drafts: list[list[int]] | None = None  # per previous request: the drafts it proposed (None: no drafts)
    num_rejected: list[int] | None = None  # per previous request: its rows minus the tokens it emitted


@dataclass
class StepBatch:
    request_ids: list[str]
    input_ids: torch.Tensor  # [R]
    positions: torch.Tensor  # [R]
    row_requests: torch.Tensor  # [R] index into the requests
    ring_slots: torch.Tensor  # [R] position mod ring size
    query_start: torch.Tensor  # [N + 1]
    first: torch.Tensor  # [N] position of each request's first row (= cached positions)
    seqlens_k: torch.Tensor  # [N] cached + new positions
    state_slots: torch.Tensor  # [N]
    block_tables: torch.Tensor  # [N, width]
    sample_rows: torch.Tensor  # [num sampled rows]
    entry_writes: dict[int, tuple[torch.Tensor, torch.Tensor]]  # ratio → (rows, entry slots)
    # Host facts of the plan (None: not known without a device read): every request has exactly one row
    # this step; the longest request's seqlen_k.
    decode_only: bool | None = None
    max_seqlen_k: int | None = None

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def num_rows(self) -> int:
        return self.positions.numel()

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @staticmethod
    def from_plan(plan: StepPlan, device: torch.device | str = "cpu") -> StepBatch:
        def t(a) -> torch.Tensor:
            return upload(_long(a), device)

        n = plan.num_requests
        seqlens_q, seqlens_k = t(plan.seqlens_q), t(plan.seqlens_k)
        host_q = np.frombuffer(plan.seqlens_q, np.int32)
        return StepBatch(
            request_ids=list(plan.request_ids),
            input_ids=t(plan.input_ids),
            positions=t(plan.positions),
            row_requests=t(plan.row_requests),
            ring_slots=t(plan.ring_slots),
            query_start=t(plan.query_start),
            first=seqlens_k - seqlens_q,
            seqlens_k=seqlens_k,
            state_slots=t(plan.state_slots),
            block_tables=t(plan.block_tables).view(n, plan.block_table_width),
            sample_rows=t(plan.sample_rows),
            entry_writes={r: (t(rows), t(slots)) for r in plan.entry_ratios for rows, slots in [plan.entry_writes(r)]},
            decode_only=bool(np.all(host_q == 1)),
            max_seqlen_k=int(np.frombuffer(plan.seqlens_k, np.int32).max(initial=0)),
        )

    def fill_pending(
        self, plan: StepPlan, pending: PendingInputs, ring_size: int | None = None, block_size: int | None = None
    ) -> None:
        """Replaces each pending request's stand-in input (its first row this step) with the token the
        previous step sampled for it, matched by request id, not batch position. With drafts, also the
        seqlen fix-up (``fix_positions``, which needs the cache's ring and block sizes): its draft rows take
        the new drafts, and its rows move down by the rows the previous step rejected."""
        where = pending_rows(plan, pending)
        if where is None:
            return
        apply_pending(self.input_ids, *where, pending.token_ids)
        if pending.drafts is not None:
            if ring_size is None or block_size is None:
                raise ValueError("pending inputs with drafts need the ring and block sizes for the seqlen fix-up")
            self.fix_positions(plan, pending, ring_size, block_size)

    def fix_positions(self, plan: StepPlan, pending: PendingInputs, ring_size: int, block_size: int) -> None:
        """Speculative decoding under async scheduling: per pending request i with s_i rejected rows in the
        previous step (``pending_shifts``), every position-derived array moves down by s_i (positions, ring
        slots, first, seqlens_k, and which rows complete a compressed entry, with their slots from the block
        table); rows 1 … of the request take its new drafts (a row past them keeps its stand-in, which the
        speculator does not count as a draft)."""
        where = {request_id: k for k, request_id in enumerate(pending.request_ids)}
        starts = np.frombuffer(plan.query_start, np.int32)
        pending_mask = np.frombuffer(plan.inputs_pending, np.int32)
        for i, request_id in enumerate(self.request_ids):
            drafts = pending.drafts[where[request_id]] if pending_mask[i] else []
            drafts = drafts[: int(starts[i + 1] - starts[i]) - 1]
            if drafts:
                first_row = int(starts[i]) + 1
                self.input_ids[first_row : first_row + len(drafts)] = torch.tensor(
                    drafts, dtype=torch.long, device=self.device
                )
        shift = upload(torch.tensor(pending_shifts(plan, pending), dtype=torch.long), self.device)
        self.positions = self.positions - shift[self.row_requests]
        self.ring_slots = self.positions % ring_size
        self.first = self.first - shift
        self.seqlens_k = self.seqlens_k - shift
        self.max_seqlen_k = None
        for ratio in list(self.entry_writes):
            epb = block_size // ratio
            rows = torch.nonzero((self.positions + 1) % ratio == 0).flatten()
            entry = self.positions[rows] // ratio
            blocks = self.block_tables[self.row_requests[rows], entry // epb]
            self.entry_writes[ratio] = (rows, blocks * epb + entry % epb)

    # ---- per-row views ---------------------------------------------------------------------

    def max_entries(self, ratio: int) -> int:
        """The most compressed entries any request has at ``ratio`` (max of seqlen_k // ratio), from the
        host fact when known: no device read."""
        if self.max_seqlen_k is not None:
            return self.max_seqlen_k // ratio
        return int((self.seqlens_k // ratio).max())

    def row_first(self) -> torch.Tensor:
        """[R] the first position of each row's request in this step."""
        return self.first[self.row_requests]

    def row_index(self, requests: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Row holding position ``positions[j, k]`` of request ``requests[j]`` this step; clamped into
        range, meaningful only where the position is ≥ that request's ``first``."""
        req = requests.view(-1, *([1] * (positions.ndim - 1)))
        return (self.query_start[req] + positions - self.first[req]).clamp(0, max(self.num_rows - 1, 0))

    def tail(self, size: int) -> torch.Tensor:
        """Bool [R]: rows among their request's last ``size`` positions, so that writes indexed by
        position mod ``size`` never collide within a step."""
        return self.positions >= self.seqlens_k[self.row_requests] - size


def pending_rows(plan: StepPlan, pending: PendingInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Host work of async scheduling's input fill: (rows of this step, indices into ``pending``), long
    [P] each, for the P requests whose first input waits on the step in flight; None when none do."""
    reqs = np.flatnonzero(np.frombuffer(plan.inputs_pending, np.int32))
    if reqs.size == 0:
        return None
    where = {request_id: k for k, request_id in enumerate(pending.request_ids)}
    ids = list(plan.request_ids)
    missing = [ids[i] for i in reqs if ids[i] not in where]
    if missing:
        raise ValueError(f"pending inputs of {missing} are not in the previous step")
    rows = np.frombuffer(plan.query_start, np.int32)[reqs].astype(np.int64)
    return torch.from_numpy(rows), torch.tensor([where[ids[i]] for i in reqs], dtype=torch.long)


def pending_shifts(plan: StepPlan, pending: PendingInputs) -> list[int]:
    """Per request of ``plan``: how many positions its rows sit too far (the rows its in-flight step did not
    accept; 0 without drafts or when its inputs do not wait on that step)."""
    if pending.num_rejected is None:
        return [0] * plan.num_requests
    where = {request_id: k for k, request_id in enumerate(pending.request_ids)}
    pending_mask = np.frombuffer(plan.inputs_pending, np.int32)
    return [
        pending.num_rejected[where[request_id]] if pending_mask[i] else 0
        for i, request_id in enumerate(plan.request_ids)
    ]


def apply_pending(input_ids: torch.Tensor, rows: torch.Tensor, src: torch.Tensor, tokens: torch.Tensor) -> None:
    """Device work of the fill: input_ids[rows] = tokens[src] where that token exists (≥ 0). A request
    with no token from the previous step (an error there) is dropped by the scheduler at its update;
    its row keeps the stand-in so the forward stays in range. Host indices are uploaded without a
    sync, and ``tokens`` (the previous step's, on the device) are never read back: the step in
    flight keeps running while this one is queued."""
    device = input_ids.device
    rows, src = upload(rows, device), upload(src, device)
    picked = tokens.to(device)[src]
    input_ids[rows] = torch.where(picked >= 0, picked, input_ids[rows])


def check_ring_slots(plan: StepPlan, ring_size: int) -> None:
    """The plan's ring slots are its positions mod the runner's ring (host arrays: no device read)."""
    positions = np.frombuffer(plan.positions, np.int32)
    if not np.array_equal(np.frombuffer(plan.ring_slots, np.int32), positions % ring_size):
        raise ValueError(
            f"the plan's ring slots are not position mod {ring_size}: the scheduler's window or "
            "nextn differs from the model runner's"
        )
