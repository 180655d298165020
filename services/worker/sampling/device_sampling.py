"""``Sampler.process`` as device work on fixed shapes: the rows' sampling parameters as device tensors
(``DeviceSampling``), so the draft proposal's slot loop (services/worker/spec/draft_proposal.py) and the static
verify (services/worker/spec/static_verify.py) process logits inside a CUDA graph, with no host read.

Invariant (tested ``==`` against ``Sampler.process``): for the same logits and rows, ``process`` gives the same
``banned``, ``logprobs``, ``probs`` and ``errors``, and, where ``needs_ranking``, every row's ``order`` (the
sampler's ``order`` is the same rows' at its ``ranked_rows``, a subset unless every row is ranked):

- every row is treated alike: a row without a rank limit gets the limit V (ranks < V keep every token, the
  sampler's all-true mask), a row without top-p keeps its logits (a ``where`` on the row's flag, never the
  mask at p = 1, which could drop a token of mass 0); every op is per row, so a row's values do not depend
  on which other rows share the call (padding rows included);
- bias and bans are fixed-capacity (row, token) lists; a padding entry points at column V of [N, V + 1]
  planes, sliced off, so it changes nothing. A biased element is x + value in fp32, the sampler's add.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.worker.sampling.sampler import MASS_BITS, ProcessedLogits, SamplingRow, integer_masses

MIN_CAPACITY = 16
"""The smallest ban or bias list a graph holds (then powers of two), so a few entries share one graph."""


def bucket(num: int, smallest: int = 1) -> int:
    """The power of two ≥ max(num, smallest)."""
    return 1 << (max(num, smallest) - 1).bit_length()


NUM_ROW_COLUMNS = 4
"""Per row in ``row_columns``: temperature (its float32 bits), rank limit, top-p mass limit, nucleus."""


@dataclass(frozen=True)
class DeviceSampling:
    """N rows' sampling parameters on the device (``Sampler.process``'s, per row)."""

    temperatures: torch.Tensor  # fp32 [N]: the pipeline's divisor (1 for greedy, ≥ float32 tiny otherwise)
    rank_limits: torch.Tensor  # int64 [N]: tokens the top-k and forced top-k keep (V: no limit)
    top_p_limits: torch.Tensor  # int64 [N]: ceil(top_p · 2³¹), the mass before a kept token stays below it
    nucleus: torch.Tensor  # bool [N]: top_p < 1 (only these rows apply the top-p mask)
    bans: tuple[torch.Tensor, torch.Tensor] | None  # (row, token id) int64 [M] each, set to −inf (token id V:
    #                                                  a padding entry, no effect); None: none
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token id, fp32 value) [L] (token id V:
    #                                                               padding); None: none
    needs_ranking: bool  # sort every row (some row has a rank limit or top-p, or the caller wants the order)
    unit_temperatures: bool = False  # every temperature is 1 (host-known: all rows greedy), so no division (x / 1 == x)

    @classmethod
    def of_columns(
        cls, columns: torch.Tensor, bans: torch.Tensor | None, bias: torch.Tensor | None, needs_ranking: bool
    ) -> DeviceSampling:
        """From int64 device tables: ``columns`` [N, NUM_ROW_COLUMNS] (``row_columns``), ``bans`` [M, 2] (row,
        token), ``bias`` [L, 3] (row, token, value's float32 bits); views and dtype casts only."""
        return cls(
            float32_of_bits(columns[:, 0]),
            columns[:, 1],
            columns[:, 2],
            columns[:, 3].bool(),
            None if bans is None else (bans[:, 0], bans[:, 1]),
            None if bias is None else (bias[:, 0], bias[:, 1], float32_of_bits(bias[:, 2])),
            needs_ranking,
        )


@dataclass(frozen=True)
class SamplingKey:
    """What fixes a static processing's shapes and code path (part of a static verify's key)."""

    needs_ranking: bool  # every row is sorted (some row has a rank limit or top-p, or the step wants top-n)
    num_bans: int  # the ban list's capacity (0: no bans)
    num_bias: int  # the bias list's capacity (0: no bias)

    @classmethod
    def of(cls, rows: Sequence[SamplingRow], rank_all: bool) -> SamplingKey | None:
        """The key of ``rows``; None where a row biases one token twice (``Sampler.process`` keeps one of the
        two writes, which the static one need not match: the eager path)."""
        for row in rows:
            if len({t for t, _ in row.logit_bias}) != len(row.logit_bias):
                return None
        bans, bias = sum(len(r.banned_token_ids) for r in rows), sum(len(r.logit_bias) for r in rows)
        return cls(
            rank_all or any(r.needs_ranking for r in rows),
            bucket(bans, MIN_CAPACITY) if bans else 0,
            bucket(bias, MIN_CAPACITY) if bias else 0,
        )

    def size(self, num_rows: int) -> int:
        """int64 entries of ``pack``'s table for ``num_rows`` rows."""
        return num_rows * NUM_ROW_COLUMNS + 2 * self.num_bans + 3 * self.num_bias

    def pack(self, rows: Sequence[SamplingRow], num_rows: int, vocab_size: int) -> list[int]:
        """``rows`` then padding rows up to ``num_rows``, then the ban and bias lists padded to capacity (padding
        entries at row 0, token V): the flat int64 table ``unpack`` reads."""
        if len(rows) > num_rows:
            raise ValueError(f"{len(rows)} rows do not fit a table of {num_rows}")
        bans, bias = entries(rows, vocab_size)
        if len(bans) > self.num_bans or len(bias) > self.num_bias:
            raise ValueError(f"{len(bans)} bans and {len(bias)} bias entries do not fit {self}")
        flat = [c for row in rows for c in row_columns(row, vocab_size)]
        flat += placeholder_columns(vocab_size) * (num_rows - len(rows))
        flat += [c for entry in bans for c in entry] + [0, vocab_size] * (self.num_bans - len(bans))
        flat += [c for entry in bias for c in entry] + [0, vocab_size, 0] * (self.num_bias - len(bias))
        return flat

    def unpack(self, table: torch.Tensor, num_rows: int) -> DeviceSampling:
        """The device table ``pack`` built (int64 [size(num_rows)]) as ``DeviceSampling``: views and casts."""
        n = num_rows * NUM_ROW_COLUMNS
        bans = table[n : n + 2 * self.num_bans].view(-1, 2) if self.num_bans else None
        bias = table[n + 2 * self.num_bans : self.size(num_rows)].view(-1, 3) if self.num_bias else None
        return DeviceSampling.of_columns(table[:n].view(num_rows, NUM_ROW_COLUMNS), bans, bias, self.needs_ranking)


def float32_bits(value: float) -> int:
    """The float32 nearest ``value`` as its bit pattern, a signed 32-bit int (exact through an int64 upload)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def float32_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 [..] whose bit patterns are the int64 ``bits`` [..] (``float32_bits``' values)."""
    return bits.to(torch.int32).view(torch.float32)


def row_columns(row: SamplingRow, vocab_size: int) -> list[int]:
    """One row's ``NUM_ROW_COLUMNS`` int64 columns: what ``Sampler.process`` derives from it."""
    tiny = torch.finfo(torch.float32).tiny
    temperature = max(row.temperature, tiny) if row.temperature > 0 else 1.0
    return [
        float32_bits(temperature),
        row.rank_limit if row.rank_limit is not None else vocab_size,
        math.ceil(row.top_p * (1 << MASS_BITS)),
        int(row.top_p < 1),
    ]


def placeholder_columns(vocab_size: int) -> list[int]:
    """A padding row's columns: temperature 1, no rank limit, no top-p."""
    return [float32_bits(1.0), vocab_size, 1 << MASS_BITS, 0]


def entries(rows: Sequence[SamplingRow], vocab_size: int) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """The rows' bans (row, token) and bias (row, token, value's float32 bits), checked against the vocabulary."""
    bans = [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids]
    bias = [(i, t, float32_bits(v)) for i, r in enumerate(rows) for t, v in r.logit_bias]
    for kind, found in (("banned", bans), ("logit_bias", bias)):
        for i, t, *_ in found:
            if not 0 <= t < vocab_size:
                raise ValueError(f"row {i}: {kind} token id {t} is outside the vocabulary [0, {vocab_size})")
    return bans, bias


def process(logits: torch.Tensor, sampling: DeviceSampling) -> ProcessedLogits:
    """``Sampler.process`` of logits [N, V] under ``sampling`` (see the module docstring), without host reads;
    where ``needs_ranking`` every row is ranked (``ranked_rows`` all N), else none."""
    s = scale(logits, sampling, keep_banned=True)
    return ProcessedLogits(
        s.banned, torch.log_softmax(s.scaled, dim=-1), torch.softmax(s.scaled, dim=-1), s.errors, s.ranked_rows, s.order
    )


@dataclass(frozen=True)
class ScaledLogits:
    """``process`` before its softmaxes: ``log_softmax`` and ``softmax`` of ``scaled`` are its logprobs and probs
    (a caller that reads one of them runs only that one)."""

    banned: torch.Tensor | None  # fp32 [N, V]: the logits after bias and bans (error rows all 0); None: not asked for
    scaled: torch.Tensor  # fp32 [N, V]: (banned - row max) / temperature, dropped tokens -inf
    errors: torch.Tensor  # bool [N]
    ranked_rows: torch.Tensor  # int64 [N] where ``needs_ranking``, else [0]
    order: torch.Tensor  # int64 [N, V] where ``needs_ranking``, else [0, V]


def scale(logits: torch.Tensor, sampling: DeviceSampling, keep_banned: bool) -> ScaledLogits:
    """``process`` up to its softmaxes (the same bits); ``keep_banned``: also the banned logits (else None where
    no row is ranked, which then needs no masked copy of the logits)."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    # No copy of fp32 logits: nothing below writes into x, and the error rows' masked_fill gives a new tensor,
    # so what comes back never aliases the caller's logits.
    x = logits.to(torch.float32)
    # Bias and bans go through [N, V + 1] planes (column V: padding entries, sliced off), built by index_put_
    # with tensor values and applied with where / masked_fill: none of these waits for the device (a scalar
    # index_put_ does), and a fixed shape is what a graph captures.
    if sampling.bias is not None:
        rows, tokens, values = sampling.bias
        plane = (num_rows, vocab_size + 1)
        shift = x.new_zeros(plane).index_put_((rows, tokens), values)[:, :vocab_size]
        has = torch.zeros(plane, dtype=torch.bool, device=device).index_put_(
            (rows, tokens), torch.ones_like(rows, dtype=torch.bool)
        )[:, :vocab_size]
        x = torch.where(has, x + shift, x)  # the biased logits: x + value exactly; the rest untouched
    if sampling.bans is not None:
        rows, tokens = sampling.bans
        banned = torch.zeros((num_rows, vocab_size + 1), dtype=torch.bool, device=device).index_put_(
            (rows, tokens), torch.ones_like(rows, dtype=torch.bool)
        )[:, :vocab_size]
        x = x.masked_fill(banned, -math.inf)
    # ``Sampler.process``'s error rows (a NaN, a +inf, or nothing finite) are exactly the rows whose max is not
    # finite: amax propagates NaN, a +inf is the max, and a row of -inf and finite values has a finite max.
    # (m - m) is 0 for a finite m and NaN otherwise. Error rows are all-zero logits, as the pipeline's, so their
    # max is 0 and their scaled row (0 - 0) / T = +0 (T > 0): the masked row's max is row_max elsewhere, and an
    # error row's scaled row can be zeroed after the division instead of before (the same bits, and no second
    # row scan nor masked copy where nothing sorts the masked logits or reads them back).
    row_max = x.amax(dim=-1, keepdim=True)
    errors = row_max - row_max != 0  # [N, 1]
    temperatures = sampling.temperatures.unsqueeze(-1)
    if sampling.needs_ranking or keep_banned:
        x = x.masked_fill(errors, 0.0)
        shifted = x - row_max.masked_fill(errors, 0.0)
        scaled = shifted if sampling.unit_temperatures else shifted / temperatures
    else:
        shifted = x - row_max
        scaled = (shifted if sampling.unit_temperatures else shifted / temperatures).masked_fill(errors, 0.0)
        x = None
    if sampling.needs_ranking:
        order = torch.sort(x, dim=-1, descending=True, stable=True).indices  # [N, V]
        ranks = torch.arange(vocab_size, device=device).expand_as(order)
        keep = torch.zeros_like(x, dtype=torch.bool).scatter_(1, order, ranks < sampling.rank_limits.unsqueeze(-1))
        scaled = scaled.masked_fill(~keep, -math.inf)
        masses = integer_masses(torch.softmax(scaled, dim=-1)).gather(1, order)
        mass_before = torch.cumsum(masses, dim=-1) - masses
        kept = torch.zeros_like(keep).scatter_(1, order, mass_before < sampling.top_p_limits.unsqueeze(-1))
        scaled = torch.where(sampling.nucleus.unsqueeze(-1), scaled.masked_fill(~kept, -math.inf), scaled)
        ranked_rows = torch.arange(num_rows, device=device)
    else:
        order = torch.empty(0, vocab_size, dtype=torch.int64, device=device)
        ranked_rows = torch.empty(0, dtype=torch.int64, device=device)
    return ScaledLogits(x, scaled, errors.squeeze(-1), ranked_rows, order)
