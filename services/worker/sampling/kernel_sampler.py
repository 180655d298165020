"""The kernel backend's sampler: ``Sampler``'s interface on the fused sampling kernel (kernels/sampler.py).

``KernelSampler()(logits, rows)`` returns the CPU ``Sampler``'s ``SamplerOutput`` (same fields, shapes
and draws; kernels/sampler.py's docstring says where an fp32 softmax may move a draw). The rows'
parameters are checked as the CPU sampler checks them (a banned id outside the vocabulary raises).

What the kernel cannot serve is refused, never routed elsewhere: more than ``MAX_TOP_LOGPROBS`` (64)
top logprobs in one batch raises ``ValueError`` (the engine's API allows at most 20).

``compile_variants`` compiles the kernel's variants a step's rows can ask for (top-n width bucket, ban-list length,
the processing pass with min-p alone, with penalties' token counts, with a structured-output mask) without running
them, in parallel threads: the warm-up before ready (services/engine/warmup.py).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
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

    def compile_variants(
        self, vocab_size: int, device: torch.device | str, num_bans: Sequence[int] = (0, 1), workers: int | None = None
    ) -> int:
        """Compiles, without a launch, each variant of the kernel that rows with up to 20 logprobs and ban lists of
        ``num_bans`` ids take (every processing form: none, min-p alone, penalties, a token mask); ``workers``
        threads (default: the CPUs) compile at once under Triton's ``AsyncCompileMode``. Returns the variants.
        Longer ban lists compile on first use, one variant per power of two of the list."""
        from triton.runtime._async_compile import AsyncCompileMode

        logits = torch.zeros(1, vocab_size, dtype=torch.float32, device=device)
        tables = (
            torch.zeros(1, vocab_size, dtype=torch.int32, device=device),
            torch.zeros(1, vocab_size, dtype=torch.bool, device=device).view(torch.uint8),
        )
        mask = torch.full((1, -(-vocab_size // 32)), -1, dtype=torch.int32, device=device)
        forms = [  # (min_p, history, counts, mask)
            (0.0, None, None, None),
            (0.05, None, None, None),
            (0.0, 0, tables, None),
            (0.0, None, None, mask),
            (0.0, 0, tables, mask),
        ]
        widths = [w for w in (0, *self.kernel.TOP_BUCKETS) if w <= 20]
        variants = list(itertools.product(num_bans, widths, forms))
        executor = ThreadPoolExecutor(max_workers=workers or os.cpu_count() or 1)
        with executor, AsyncCompileMode(executor):
            for bans, width, (min_p, history, counts, token_mask) in variants:
                row = SamplingRow(
                    temperature=1.0,
                    top_k=-1,
                    top_p=1.0,
                    seed=0,
                    position=0,
                    forced_top_k=None,
                    banned_token_ids=tuple(range(bans)),
                    num_logprobs=width,
                    min_p=min_p,
                    history=history,
                )
                params = self.kernel.sampling_tensors([row], device)
                self.kernel.sample(logits, params, width, counts=counts, token_bitmask=token_mask, launch=False)
        return len(variants)
