"""The kernel backend's sampler: ``Sampler``'s interface on the fused sampling kernel (kernels/sampler.py).

``KernelSampler()(logits, rows)`` returns the CPU ``Sampler``'s ``SamplerOutput`` (same fields, shapes
and draws; kernels/sampler.py's docstring says where an fp32 softmax may move a draw). The rows'
parameters are checked as the CPU sampler checks them (a banned id outside the vocabulary raises).

What the kernel cannot serve is refused, never routed elsewhere: more than ``MAX_TOP_LOGPROBS`` (64)
top logprobs in one batch raises ``ValueError`` (the engine's API allows at most 20).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from kernels.device import upload
from kernels.sampler_output import SamplerOutput
from services.worker.sampling.sampler import SamplingRow, with_logit_bias
from services.worker.sampling.token_counts import TokenCounts


class KernelSampler:
    """Stateless but for the kernel module: ``kernels.sampler`` compiled (default) or an interpreted copy."""

    def __init__(self, kernel: ModuleType | None = None) -> None:
        if kernel is None:
            import kernels.sampler as kernel
        self.kernel = kernel

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        counts: TokenCounts | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """logits [n, V] (one row per ``rows`` entry) → SamplerOutput with w = min(max num_logprobs, V) columns;
        ``counts``: the penalties' token counts (rows with penalties need them), read in place by the kernel;
        ``token_bitmask``: the structured-output mask (token_bitmask.py), applied inside the kernel (its pass 0,
        right after the bans, as the CPU sampler applies it)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")
        vocab_size = logits.shape[1]
        for i, row in enumerate(rows):
            bad = [t for t in row.banned_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"row {i}: banned token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        width = min(max((r.num_logprobs for r in rows), default=0), vocab_size)
        if width > self.kernel.MAX_TOP_LOGPROBS:
            raise ValueError(
                f"the sampling kernel returns at most {self.kernel.MAX_TOP_LOGPROBS} top logprobs, "
                f"a row asks for {width}"
            )
        params = self.kernel.sampling_tensors(rows, logits.device)
        if any(r.logit_bias for r in rows):  # added before the kernel, in fp32, as the CPU sampler adds them
            logits = with_logit_bias(logits.to(torch.float32, copy=True), rows)
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        if params.needs_counts and counts is None:
            raise ValueError("rows with penalties need the token counts (TokenCounts)")
        tables = None if counts is None else (counts.output, counts.prompt)
        mask = None
        if token_bitmask is not None:
            if token_bitmask.shape[0] != len(rows):
                raise ValueError(f"the token bitmask has {token_bitmask.shape[0]} rows for {len(rows)} logits rows")
            mask = upload(token_bitmask.to(torch.int32).contiguous(), logits.device)
        return self.kernel.sample(logits, params, width, counts=tables, token_bitmask=mask)
