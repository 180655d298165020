"""Interleaved partial RoPE (spec §3.5).

Only the trailing ``qk_rope_head_dim`` channels rotate, as adjacent pairs (2i, 2i+1) treated as
complex numbers. Ratio-0 layers use the main base without YaRN; ratio>0 layers use the compress
base with YaRN frequency interpolation (no cos/sin scaling, no mscale).
"""

from __future__ import annotations

import math

import torch

from model.deepseek_v41.config import ModelConfig


def rope_frequencies(cfg: ModelConfig, *, compressed: bool) -> torch.Tensor:
    """Angular frequencies ω_i, fp32 [rope_dim/2]."""
    dim = cfg.qk_rope_head_dim
    theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if not compressed:
        return freqs
    y = cfg.rope_scaling
    # YaRN ramp bounds: the pair indices whose wavelength crosses beta_fast / beta_slow turns.
    low = max(
        math.floor(
            dim * math.log(y.original_max_position_embeddings / (y.beta_fast * 2 * math.pi)) / (2 * math.log(theta))
        ),
        0,
    )
    high = min(
        math.ceil(
            dim * math.log(y.original_max_position_embeddings / (y.beta_slow * 2 * math.pi)) / (2 * math.log(theta))
        ),
        dim - 1,
    )
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / y.factor * ramp + freqs * (1 - ramp)


def rope_angles(positions: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """positions int [...] → angles fp32 [..., rope_dim/2]."""
    return positions.float().unsqueeze(-1) * freqs


def rope_turns(angles: torch.Tensor) -> torch.Tensor:
    """angles fp32 [..., P] → the unit complex numbers e^{iθ} complex64 [..., P] that ``apply_rope``
    multiplies by. Every ``apply_rope`` taking angles computes exactly these, so passing the turns in place
    of the angles gives the same bits; a step computes them once per frequency set, not once per layer."""
    return torch.polar(torch.ones_like(angles), angles)


def apply_rope(x: torch.Tensor, angles: torch.Tensor, *, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2·angles.shape[-1]`` channels of x.

    x: [B, S, C] or [B, S, H, C]; angles: fp32 [B, S, P] (or broadcastable [S, P]), or their turns
    (``rope_turns``: complex, same shape). Returns x's shape and dtype.
    ``inverse`` rotates by −angle (used to undo RoPE on the attention output).
    """
    rot = angles.shape[-1] * 2
    return torch.cat((x[..., :-rot], _rotated(x, angles, inverse)), dim=-1)


def apply_rope_(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``apply_rope`` in place: only the rotated channels are written (a query's 64 of 512 per head,
    where ``apply_rope`` copies all 512). Returns x.

    An fp32 x whose rotated channels view as complex pairs is rotated by one in-place complex multiply of
    that view: the same products as ``_rotated``'s ``pairs * turn`` (an elementwise op: each output is
    computed from the same two inputs, whatever the layout), written where ``_rotated``'s result would be
    copied to."""
    rot = angles.shape[-1] * 2
    pairs = x[..., -rot:].unflatten(-1, (-1, 2))  # [..., P, 2] view of x
    if x.dtype == torch.float32 and _views_as_complex(pairs):
        torch.view_as_complex(pairs).mul_(_turns(x, angles, False))
    else:
        x[..., -rot:] = _rotated(x, angles, False)
    return x


def _views_as_complex(pairs: torch.Tensor) -> bool:
    """Whether ``torch.view_as_complex`` accepts pairs [..., P, 2] as it is: the pair's two floats adjacent,
    and every other stride and the storage offset even (whole complex elements)."""
    return pairs.stride(-1) == 1 and pairs.storage_offset() % 2 == 0 and all(s % 2 == 0 for s in pairs.stride()[:-1])


def _turns(x: torch.Tensor, angles: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The turns that rotate x's pairs: complex [B, S, P], or [B, S, 1, P] over x's heads."""
    turn = angles if angles.is_complex() else rope_turns(angles)  # [B, S, P] complex
    if x.ndim == angles.ndim + 1:
        turn = turn.unsqueeze(-2)  # broadcast over heads
    return turn.conj() if inverse else turn


def _rotated(x: torch.Tensor, angles: torch.Tensor, inverse: bool) -> torch.Tensor:
    """The last 2P channels of x rotated, in x's dtype: [..., 2P]. The pairs are read where they lie (no
    copy) when they view as complex; the multiply is elementwise, so the layout does not change its bits."""
    rot = angles.shape[-1] * 2
    pairs = x[..., -rot:].float().unflatten(-1, (-1, 2))  # [..., P, 2]
    if not _views_as_complex(pairs):
        pairs = pairs.contiguous()
    return torch.view_as_real(torch.view_as_complex(pairs) * _turns(x, angles, inverse)).flatten(-2).to(x.dtype)
