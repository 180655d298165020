"""The sampler's output, one type for the CPU sampler (``services.worker.sampling.sampler.Sampler``) and the fused
one (``kernels.sampler.sample``): both fill it with the same contract, so callers never ask which ran."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerOutput:
    """One entry per input row, in input order.

    ``top_*`` are dense [n, w] with w = min(max num_logprobs, vocab): row i's first
    ``rows[i].num_logprobs`` columns are its answer, best first, ties to the lower id; the columns after
    those are the next ranks (real tokens and logprobs, never padding) and the caller slices them off.
    Tokens outside the kept set have logprob -inf. Error rows get ids from rank order and -inf.
    """

    token_ids: torch.Tensor  # [n] int64
    logprobs: torch.Tensor  # [n] float32, the chosen token's, under the processed distribution
    top_token_ids: torch.Tensor  # [n, w] int64
    top_logprobs: torch.Tensor  # [n, w] float32
    errors: torch.Tensor  # [n] bool: every token masked (or a NaN/+inf logit) → end with `error`
