"""A StepPlan as the tensors the cached forward indexes with (one row per planned token).

Rows of request i are contiguous, rows ``query_start[i] … query_start[i+1]−1``, at consecutive
positions ``first[i] … seqlens_k[i]−1``; positions below ``first[i]`` are cached (rings, blocks,
partial groups, Engram history), positions from it on are this step's rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from scheduler_rs import StepPlan


def _long(a) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(a, np.int32).astype(np.int64))


@dataclass
class PendingInputs:
    """Async scheduling: the step in flight's request ids and the last token each sampled (−1 = none)."""

    request_ids: list[str]
    token_ids: torch.Tensor  # [N prev] long


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
            return _long(a).to(device)

        n = plan.num_requests
        seqlens_q, seqlens_k = t(plan.seqlens_q), t(plan.seqlens_k)
        return StepBatch(
            request_ids=list(plan.request_ids), input_ids=t(plan.input_ids), positions=t(plan.positions),
            row_requests=t(plan.row_requests), ring_slots=t(plan.ring_slots), query_start=t(plan.query_start),
            first=seqlens_k - seqlens_q, seqlens_k=seqlens_k, state_slots=t(plan.state_slots),
            block_tables=t(plan.block_tables).view(n, plan.block_table_width), sample_rows=t(plan.sample_rows),
            entry_writes={r: (t(rows), t(slots)) for r in plan.entry_ratios for rows, slots in [plan.entry_writes(r)]},
        )

    def fill_pending(self, plan: StepPlan, pending: PendingInputs) -> None:
        """Replaces each pending request's stand-in input (its first row this step) with the token the
        previous step sampled for it, matched by request id, not batch position. On a GPU a kernel does
        this gather/scatter; here the same index arithmetic runs in torch."""
        mask = _long(plan.inputs_pending).to(self.device).bool()  # [N]
        reqs = mask.nonzero().flatten()
        if reqs.numel() == 0:
            return
        where = {rid: k for k, rid in enumerate(pending.request_ids)}
        missing = [self.request_ids[i] for i in reqs.tolist() if self.request_ids[i] not in where]
        if missing:
            raise ValueError(f"pending inputs of {missing} are not in the previous step")
        src = torch.tensor([where[self.request_ids[i]] for i in reqs.tolist()], dtype=torch.long, device=self.device)
        tokens = pending.token_ids.to(self.device)[src]
        # A request with no token from the previous step (an error there) is dropped by the scheduler at its
        # update; its row keeps the stand-in so the forward stays in range.
        rows = self.query_start[reqs]
        self.input_ids[rows] = torch.where(tokens >= 0, tokens, self.input_ids[rows])

    # ---- per-row views ---------------------------------------------------------------------

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
