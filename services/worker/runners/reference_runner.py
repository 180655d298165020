"""A model runner that recomputes each request's whole sequence with the full-sequence reference
forward every step. It reads no cache, so it is slow (quadratic) but obviously right: the test
oracle for the cached runner, and a way to run the engine before the caches exist.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.deepseek_v41.model import DeepseekV41
from scheduler_rs import StepPlan


@dataclass
class RunnerOutput:
    # [num sampled rows, vocab] fp32, rows in `plan.sample_rows` order.
    logits: torch.Tensor
    # [num layers, num routed experts] tokens routed per expert this step, when the runner counts.
    expert_counts: torch.Tensor | None = None
    # Rows the model ran (Σ seqlen_q for a cached runner).
    num_rows_computed: int = 0
    # [num rows, T·D] fp32, every row in plan row order: the DSpark draft's target features, when the runner
    # taps them (a runner built for speculative decoding); None otherwise.
    taps: torch.Tensor | None = None


class ReferenceRunner:
    def __init__(self, model: DeepseekV41) -> None:
        self.model = model
        # request id -> tokens by position, as the plans delivered them.
        self.history: dict[str, list[int]] = {}

    def release(self, request_id: str) -> None:
        self.history.pop(request_id, None)

    @torch.no_grad()
    def execute(self, plan: StepPlan) -> RunnerOutput:
        positions = plan.positions.tolist()
        input_ids = plan.input_ids.tolist()
        starts = plan.query_start.tolist()
        seqlens_k = plan.seqlens_k.tolist()
        num_sample_rows = plan.num_sample_rows.tolist()
        wanted: list[tuple[int, int, int]] = []  # (batch row, first position, count)
        sequences: list[list[int]] = []
        for i, request_id in enumerate(plan.request_ids):
            tokens = self.history.setdefault(request_id, [])
            for row in range(starts[i], starts[i + 1]):
                p = positions[row]
                del tokens[p:]  # a recompute or a rejected draft rewrites from here
                tokens.append(input_ids[row])
            if num_sample_rows[i]:
                wanted.append((len(sequences), seqlens_k[i] - num_sample_rows[i], num_sample_rows[i]))
                sequences.append(tokens[: seqlens_k[i]])
        vocab = self.model.cfg.vocab_size
        if not sequences:
            return RunnerOutput(torch.empty(0, vocab), None, 0)
        # One causal forward over right-padded sequences: padding after a position cannot reach it.
        width = max(len(t) for t in sequences)
        ids = torch.zeros(len(sequences), width, dtype=torch.long)
        for b, t in enumerate(sequences):
            ids[b, : len(t)] = torch.tensor(t)
        out = self.model(ids)  # [B, S, V]
        stacked = torch.cat([out[b, first : first + n] for b, first, n in wanted]).float()
        computed = int(ids.numel())
        return RunnerOutput(stacked, None, computed)
