"""The structured-output token bitmask: which tokens each sampled row may take.

Layout: int32 [n, ceil(V / 32)], one row per sampled row; bit t (least significant first) of word w allows
token 32·w + t. All bits set (-1) allows everything (an unconstrained row). The engine fills it per step from
each constrained request's grammar matcher (services/engine/structured/); the sampler sets the logits of
disallowed tokens to -inf right after the bans, so greedy, the draw, top-k/top-p and the logprobs all see it.
"""

from __future__ import annotations

import math

import torch

from kernels.device import upload


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """bool [n, vocab_size] on ``device``: True where the bitmask allows the token."""
    if bitmask.dim() != 2 or bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"the token bitmask must be [n, >= {math.ceil(vocab_size / 32)}], got {tuple(bitmask.shape)}")
    words = upload(bitmask.to(torch.int32), device)
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1  # [n, W, 32]; >> of int32 is arithmetic, & 1 keeps the bit
    return bits.reshape(words.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(x: torch.Tensor, bitmask: torch.Tensor | None) -> None:
    """Sets, in place, the logits [n, V] of the tokens ``bitmask`` disallows to -inf."""
    if bitmask is None:
        return
    if bitmask.shape[0] != x.shape[0]:
        raise ValueError(f"the token bitmask has {bitmask.shape[0]} rows for {x.shape[0]} logits rows")
    x.masked_fill_(~allowed_tokens(bitmask, x.shape[1], x.device), -math.inf)
