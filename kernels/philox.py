"""Philox4x32-10, the counter-based generator behind every random draw of the sampler.

A draw is a pure function of ``(seed, stream)`` with ``stream = 3 × position + case``
(walkthrough, "The random key"): nothing about the batch, the row or the device enters it.

The generator is Salmon et al.'s Philox4x32 with 10 rounds (Random123), written with int64 torch ops
only, so CPU and GPU give the same bits. Every int64 here holds an unsigned 32-bit word in [0, 2³²);
products are split into 16-bit halves so no int64 ever overflows.

Key and counter layout of a draw (fixed; changing it changes every sampled token):

- key     = (seed mod 2⁶⁴) as (low 32 bits, high 32 bits)
- counter = (stream low 32 bits, stream high 32 bits, 0, 0)
- bits    = the top 31 bits of the first output word, an integer in [0, 2³¹); the uniform it stands
  for is ``bits / 2³¹`` in [0, 1). 31 bits match the sampler's integer mass unit of 2³¹.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

MASK32 = 0xFFFFFFFF
# Multipliers and Weyl key increments of Philox4x32 (Random123, philox.h).
PHILOX_M0 = 0xD2511F53
PHILOX_M1 = 0xCD9E8D57
PHILOX_W0 = 0x9E3779B9
PHILOX_W1 = 0xBB67AE85
NUM_ROUNDS = 10
# A draw's bits are in [0, 2**DRAW_BITS).
DRAW_BITS = 31


class DrawCase(enum.IntEnum):
    """The ``case`` of ``stream = 3 × position + case``."""

    SAMPLE = 0  # a fresh sample
    RESAMPLE = 1  # the resample after a rejected draft
    ACCEPT = 2  # the accept-or-reject coin of a draft


def _mulhilo(a: torch.Tensor, multiplier: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of ``a × multiplier``; ``a`` holds words in [0, 2³²)."""
    # a × m = (a_hi·2¹⁶ + a_lo)·m; each partial product is < 2⁴⁸, so int64 never overflows.
    t_lo = (a & 0xFFFF) * multiplier
    t_hi = (a >> 16) * multiplier
    mid = t_lo + ((t_hi & 0xFFFF) << 16)  # < 2⁴⁹
    return (t_hi >> 16) + (mid >> 32), mid & MASK32


def philox4x32(counter: torch.Tensor, key: torch.Tensor, num_rounds: int = NUM_ROUNDS) -> torch.Tensor:
    """Philox4x32-``num_rounds`` of ``counter`` [..., 4] under ``key`` [..., 2]; returns [..., 4].

    All three hold unsigned 32-bit words as int64 in [0, 2³²); shapes broadcast.
    """
    if counter.dtype != torch.int64 or key.dtype != torch.int64:
        raise TypeError("philox4x32 takes int64 tensors holding 32-bit words")
    c0, c1, c2, c3 = counter.unbind(-1)
    k0, k1 = key.unbind(-1)
    for r in range(num_rounds):
        if r:  # Random123 bumps the key before every round after the first.
            k0 = (k0 + PHILOX_W0) & MASK32
            k1 = (k1 + PHILOX_W1) & MASK32
        hi0, lo0 = _mulhilo(c0, PHILOX_M0)
        hi1, lo1 = _mulhilo(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return torch.stack((c0, c1, c2, c3), dim=-1)


def stream_of(position: int, case: DrawCase | int) -> int:
    """The stream of a draw: ``3 × position + case``; ``position`` is the index of the token made."""
    if position < 0:
        raise ValueError(f"a draw's position must be >= 0, got {position}")
    if case not in (0, 1, 2):
        raise ValueError(f"a draw's case must be 0, 1 or 2, got {case}")
    stream = 3 * position + int(case)
    if stream >= 1 << 64:
        raise ValueError(f"stream {stream} of position {position} does not fit 64 bits")
    return stream


def draw_bits(
    seeds: Sequence[int],
    positions: Sequence[int],
    case: DrawCase | int = DrawCase.SAMPLE,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """One draw per row: int64 [n] in [0, 2³¹), a pure function of (seed, 3 × position + case).

    A seed is any Python int, taken mod 2⁶⁴ (so -1 and 2⁶⁴ - 1 are the same seed).
    """
    if len(seeds) != len(positions):
        raise ValueError(f"{len(seeds)} seeds but {len(positions)} positions")
    words = []
    for seed, position in zip(seeds, positions):
        seed &= (1 << 64) - 1
        stream = stream_of(position, case)
        words.append((stream & MASK32, stream >> 32, 0, 0, seed & MASK32, seed >> 32))
    table = torch.tensor(words, dtype=torch.int64, device=device).reshape(len(words), 6)
    out = philox4x32(table[:, :4], table[:, 4:])
    return out[:, 0] >> (32 - DRAW_BITS)


COUPLING_WORD = 1
"""Counter word 3 of ``draw_bits_per_token``'s draws; ``draw_bits`` uses 0, so the two never share a counter."""


def draw_bits_per_token(
    seeds: Sequence[int] | torch.Tensor,
    positions: Sequence[int] | torch.Tensor,
    vocab_size: int,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """One draw per row and token id: int64 [n, vocab_size] in [0, 2³¹), a pure function of
    (seed, 3 × position + SAMPLE, token id), for position-keyed coupling (the deterministic speculative
    mode's Gumbel noise). Counter = (stream low, stream high, token id, ``COUPLING_WORD``)."""
    if not isinstance(seeds, torch.Tensor):  # any Python int, mod 2**64, held as its two's-complement int64
        seeds = [(s & ((1 << 64) - 1)) - ((1 << 64) if s & (1 << 63) else 0) for s in (int(s) for s in seeds)]
    seeds = torch.as_tensor(seeds, dtype=torch.int64, device=device).reshape(-1)
    positions = torch.as_tensor(positions, dtype=torch.int64, device=seeds.device).reshape(-1)
    if seeds.shape != positions.shape:
        raise ValueError(f"{seeds.numel()} seeds but {positions.numel()} positions")
    if bool((positions < 0).any()) or bool((positions >= 1 << 60).any()):
        raise ValueError("a draw's position must be in [0, 2**60)")
    stream = 3 * positions + int(DrawCase.SAMPLE)  # < 2**62: fits int64
    key = torch.stack((seeds & MASK32, (seeds >> 32) & MASK32), dim=-1).unsqueeze(1)  # [n, 1, 2] (two's complement)
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device)
    counter = torch.stack(
        torch.broadcast_tensors(
            (stream & MASK32).unsqueeze(1),
            (stream >> 32).unsqueeze(1),
            token.unsqueeze(0),
            torch.full((1, 1), COUPLING_WORD, dtype=torch.int64, device=seeds.device),
        ),
        dim=-1,
    )  # [n, V, 4]
    return philox4x32(counter, key)[..., 0] >> (32 - DRAW_BITS)


def bits_of_uniform(u: float) -> int:
    """The draw bits that stand for the uniform ``u`` in [0, 1): floor(u · 2³¹).

    For tests and worked examples ("the draw is 0.93"); real draws come from :func:`draw_bits`.
    """
    if not 0.0 <= u < 1.0:
        raise ValueError(f"a uniform draw is in [0, 1), got {u}")
    return int(u * (1 << DRAW_BITS))  # exact: u is a double, the scale a power of two


def uniform_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in [0, 1) for draw bits; exact (31 bits fit a double's mantissa)."""
    return bits.to(torch.float64) / float(1 << DRAW_BITS)
