"""The sampler: turns one logits row per sampled request into a token, its logprob and the top-n logprobs.

Pipeline per row, in DeepInfer's order (walkthrough, "The sampling pipeline, in order"):

0. logit bias: each row's ``logit_bias`` added to its logits (fp32);
1. bans: ``banned_token_ids`` (the blacklist, plus the end and stop tokens while the first-n ban or min_tokens
   applies) → -inf, then the structured-output token bitmask's disallowed tokens → -inf
   (services/worker/sampling/token_bitmask.py);
1a. penalties: repetition, then frequency, then presence, over the request's token counts
   (services/worker/sampling/penalties.py has the exact arithmetic);
1b. min-p: tokens whose (logit − max) / T falls below log(min_p) → -inf (T as in step 3);
2. forced top-k: keep the ``forced_top_k`` highest logits;
3. temperature: ``(logit - max) / T``; T = 0 is greedy and processes the logprobs at T = 1 (below);
4. top-k: keep the ``top_k`` highest;
5. top-p: keep the most likely tokens until their mass reaches at least ``top_p``;
6. renormalise (softmax over what is kept);
7. logprobs of that processed distribution;
8. draw (or argmax when greedy), unless the row forces its token (``forced_token_id``): then that token,
   with its logprob under the same processed distribution.

Invariants:

- Rankings ("highest", "most likely") are by the banned logits, descending, ties to the lower id. One
  stable sort serves the forced top-k, top-k, top-p and the top-n logprobs (temperature > 0 keeps order).
- Every float op on a row reads only that row, in token-id order; sorts only make keep masks. A row's
  outputs are therefore independent of its batch companions, its row index and the batch size.
- Probability mass is integers: mass = floor(p · 2³¹) (int64), summed in int64, so sums are exact in any
  order. Top-p keeps rank r iff the integer mass of ranks < r is below top_p · 2³¹.
- The draw: ``bits`` in [0, 2³¹) from Philox (see ``kernels/philox.py``) stands for u = bits / 2³¹. With
  ``total`` the row's actual integer mass (not 2³¹, so the last token stays reachable), the threshold is
  ``(bits · total) >> 31`` = floor(u · total), and the token is the first id, in id order, whose inclusive
  cumulative mass exceeds it. A token of mass 0 is never picked.
- Greedy (T = 0): argmax of the banned logits, ties to the lowest id. Its logprobs are those of the
  processed distribution at T = 1: the model's own confidence after bans, forced top-k, top-k and top-p.
  The T → 0 limit would report 0 for the argmax and -inf for everything else, which says nothing.
- A row with no finite logit after the bans, or with a NaN or +inf logit, is an error row: token 0,
  logprob -inf, errors[i] = True. No exception; the other rows are unaffected.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kernels.device import upload
from kernels.philox import DRAW_BITS, DrawCase, bits_of_uniform, draw_bits, uniform_of_bits
from kernels.sampler_output import SamplerOutput
from services.worker.sampling.penalties import apply_min_p, apply_penalties
from services.worker.sampling.token_bitmask import apply_token_bitmask
from services.worker.sampling.token_counts import TokenCounts

# Probability mass unit: a probability p is worth floor(p · 2**MASS_BITS) integer units.
MASS_BITS = 31
# The draw's bits are multiplied by a row's total mass in int64; both must stay below 2**32.
assert DRAW_BITS == MASS_BITS


@dataclass(frozen=True)
class SamplingRow:
    """One sampled row's parameters, built by the engine."""

    # 0 → greedy argmax, ties to the lowest id; else finite and > 0.
    temperature: float
    # -1 or 0 = off (the user-facing convention); else keep the top_k highest.
    top_k: int
    # In (0, 1]; 1 = off.
    top_p: float
    # Any int, taken mod 2**64; the engine gives seedless requests their own random seed.
    seed: int
    # Index of the token being produced (the draw's position), >= 0.
    position: int
    # DeepInfer's force top-k: shrink to the top N before everything else; None = off.
    forced_top_k: int | None
    # The blacklist plus, while the first-n end-token ban applies, the end token.
    banned_token_ids: tuple[int, ...]
    # Top-n logprobs to return; 0 returns only the chosen token's.
    num_logprobs: int
    # The token to output instead of the draw (its logprob still under the processed distribution); None = draw.
    forced_token_id: int | None = None
    # (token id, bias) pairs added to the row's logits before the bans (OpenAI's logit_bias).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # Penalties over the request's tokens (services/worker/sampling/penalties.py); each acts at its float32 value.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Drop tokens below min_p times the most likely token's probability (at the pipeline's temperature); 0 = off.
    min_p: float = 0.0
    # The request's slot in the worker's TokenCounts (services/worker/sampling/token_counts.py); needed by the
    # penalties, None otherwise.
    history: int | None = None
    # On the request's first sampled row only: its prompt, with which the worker opens ``history`` first.
    history_prompt: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or positive, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.position < 0:
            raise ValueError(f"position must be >= 0, got {self.position}")
        if self.forced_top_k is not None and self.forced_top_k < 1:
            raise ValueError(f"forced_top_k must be positive or None, got {self.forced_top_k}")
        if self.num_logprobs < 0:
            raise ValueError(f"num_logprobs must be >= 0, got {self.num_logprobs}")
        if self.forced_token_id is not None and self.forced_token_id < 0:
            raise ValueError(f"forced_token_id must be >= 0 or None, got {self.forced_token_id}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0 or not math.isfinite(self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be finite and > 0, got {self.repetition_penalty}")
        if self.has_penalties and self.history is None:
            raise ValueError("a row with penalties needs its request's token-count slot (history)")
        object.__setattr__(self, "banned_token_ids", tuple(self.banned_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in self.logit_bias))
        if any(t < 0 or not math.isfinite(v) for t, v in self.logit_bias):
            raise ValueError(f"logit_bias needs token ids >= 0 and finite values, got {self.logit_bias}")

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def rank_limit(self) -> int | None:
        """How many of the highest-ranked tokens the forced top-k and top-k keep; None = all."""
        limits = [k for k in (self.forced_top_k, self.top_k) if k is not None and k > 0]
        return min(limits) if limits else None

    @property
    def needs_ranking(self) -> bool:
        return self.rank_limit is not None or self.top_p < 1 or self.num_logprobs > 0


def with_logit_bias(x: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """fp32 logits [n, V] with each row's ``logit_bias`` added, in place when ``x`` is already fp32 and
    owned by the caller; one fp32 add per biased element, so both samplers read the same values."""
    row_ids, token_ids, values = [], [], []
    for i, row in enumerate(rows):
        for t, v in row.logit_bias:
            if t >= x.shape[1]:
                raise ValueError(f"row {i}: logit_bias token id {t} is outside the vocabulary [0, {x.shape[1]})")
            row_ids.append(i)
            token_ids.append(t)
            values.append(v)
    if row_ids:  # uploaded without a sync: a list built on a GPU waits for the step in flight (async scheduling)
        index = (host_built(row_ids, torch.int64, x.device), host_built(token_ids, torch.int64, x.device))
        x[index] = x[index] + host_built(values, torch.float32, x.device)
    return x


def host_built(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype, device=device)`` built on the host and uploaded without a sync:
    a list built straight on a GPU is a pageable copy that waits for the stream (the step in flight)."""
    return upload(torch.tensor(values, dtype=dtype), device)


def integer_masses(probs: torch.Tensor) -> torch.Tensor:
    """floor(p · 2³¹) as int64; exact for float32/float64 probabilities in [0, 1]."""
    return torch.floor(probs.to(torch.float64) * float(1 << MASS_BITS)).to(torch.int64)


def pick_from_bits(probs: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """:func:`sample_from_bits` without its checks, so without host reads: the caller guarantees what they
    check (finite nonnegative probs [n, V] whose integer mass is in (0, 2³²), bits [n] in [0, 2³¹)), as a
    softmax's output over any vocabulary below 2³¹ has."""
    masses = integer_masses(probs)
    cumulative = torch.cumsum(masses, dim=-1)
    total = cumulative[:, -1:]
    # bits < 2³¹ and total < 2³², so the product fits int64; threshold < total for total > 0.
    threshold = (bits.to(torch.int64).unsqueeze(-1) * total) >> DRAW_BITS
    # The first id whose cumulative mass exceeds the threshold = how many ids stay at or below it.
    return (cumulative <= threshold).sum(dim=-1)


def sample_from_bits(probs: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Token ids [n] drawn from ``probs`` [n, V] (any nonnegative row scale) with draw bits [n] in [0, 2³¹)."""
    if probs.dim() != 2 or bits.shape != probs.shape[:1]:
        raise ValueError(f"probs must be [n, V] and bits [n], got {tuple(probs.shape)} and {tuple(bits.shape)}")
    if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
        raise ValueError("probs must be finite and nonnegative")
    if bool((bits < 0).any()) or bool((bits >= 1 << DRAW_BITS).any()):
        raise ValueError(f"draw bits must be in [0, 2**{DRAW_BITS})")
    total = integer_masses(probs).sum(dim=-1)
    if bool((total <= 0).any()) or bool((total >= 1 << 32).any()):
        raise ValueError("every row's integer mass must be in (0, 2**32): probabilities summing to about 1")
    return pick_from_bits(probs, bits)


def sample_from_uniform(probs: torch.Tensor, u: float | Sequence[float]) -> torch.Tensor:
    """:func:`sample_from_bits` with the draws given as uniforms in [0, 1) (bits = floor(u · 2³¹))."""
    uniforms = [u] * probs.shape[0] if isinstance(u, (int, float)) else list(u)
    bits = host_built([bits_of_uniform(x) for x in uniforms], torch.int64, probs.device)
    return sample_from_bits(probs, bits)


def accept_draft(target_logprob: torch.Tensor, draft_logprob: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Speculative decoding's coin (walkthrough, "Accepting a draft"): accept iff u < exp(min(t - d, 0)).

    ``bits`` come from ``draw_bits(..., DrawCase.ACCEPT)``; u = bits / 2³¹. A draft outside the kept set
    has t = -inf and always fails. Speculative verification (services/worker/spec/verifier.py) calls it.
    """
    ratio = torch.exp(torch.clamp(target_logprob.to(torch.float64) - draft_logprob.to(torch.float64), max=0.0))
    return uniform_of_bits(bits) < ratio


def _check_shape(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [len(rows)={len(rows)}, vocab], got {tuple(logits.shape)}")


@dataclass
class ProcessedLogits:
    """Steps 1-7 of the pipeline for a batch: what the draw and the logprobs read."""

    banned: torch.Tensor  # [n, V] float32 logits after the bans (error rows all 0); greedy reads these
    logprobs: torch.Tensor  # [n, V] float32 log of the processed distribution; dropped tokens -inf
    probs: torch.Tensor  # [n, V] float32 the processed distribution
    errors: torch.Tensor  # [n] bool
    ranked_rows: torch.Tensor  # [m] int64 rows that were ranked
    order: torch.Tensor  # [m, V] int64 token ids of those rows by rank (banned logit desc, ties lower id)


class Sampler:
    """Stateless; ``__call__`` is the whole pipeline of the module docstring."""

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        counts: TokenCounts | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> SamplerOutput:
        """``counts``: the penalties' token counts (rows with penalties need them); ``token_bitmask``: the
        structured-output mask [n, ceil(V / 32)] int32 (token_bitmask.py), None when no row is constrained."""
        _check_shape(logits, rows)
        num_rows, vocab_size = logits.shape
        width = min(max((r.num_logprobs for r in rows), default=0), vocab_size)
        # With any top-n requested every row is ranked, so top_* are in rank order for all rows.
        p = self.process(logits, rows, rank_all=width > 0, counts=counts, token_bitmask=token_bitmask)
        device = logits.device
        # Philox on the host (integer ops: the device's bits exactly), uploaded without a sync.
        bits = upload(draw_bits([r.seed for r in rows], [r.position for r in rows], DrawCase.SAMPLE), device)
        drawn = pick_from_bits(p.probs, bits)
        greedy = host_built([r.temperature == 0 for r in rows], torch.bool, device)
        tokens = torch.where(greedy, torch.argmax(p.banned, dim=-1), drawn)
        forced = [(i, r.forced_token_id) for i, r in enumerate(rows) if r.forced_token_id is not None]
        if forced:
            if any(t >= vocab_size for _, t in forced):
                raise ValueError(f"a forced token id is outside the vocabulary [0, {vocab_size})")
            index, ids = zip(*forced)
            tokens[host_built(index, torch.int64, device)] = host_built(ids, tokens.dtype, device)
        tokens = tokens.masked_fill(p.errors, 0)
        chosen = p.logprobs.gather(1, tokens.unsqueeze(-1)).squeeze(-1).masked_fill(p.errors, -math.inf)
        if width > 0:
            top_ids = p.order[:, :width].contiguous()  # a copy: the full [n, V] order is freed
        else:
            top_ids = torch.empty(num_rows, 0, dtype=torch.int64, device=device)
        top_logprobs = p.logprobs.gather(1, top_ids).masked_fill(p.errors.unsqueeze(-1), -math.inf)
        return SamplerOutput(tokens, chosen, top_ids, top_logprobs, p.errors)

    def process(
        self,
        logits: torch.Tensor,
        rows: Sequence[SamplingRow],
        rank_all: bool = False,
        counts: TokenCounts | None = None,
        token_bitmask: torch.Tensor | None = None,
    ) -> ProcessedLogits:
        """Bias, bans and the token bitmask, penalties, min-p, forced top-k, temperature, top-k, top-p and
        renormalisation; ``rank_all`` ranks every row."""
        _check_shape(logits, rows)
        vocab_size = logits.shape[1]
        device = logits.device
        x = with_logit_bias(logits.to(torch.float32, copy=True), rows)
        self._ban(x, rows)
        apply_token_bitmask(x, token_bitmask)
        apply_penalties(x, rows, counts)
        apply_min_p(x, rows)
        errors = torch.isnan(x).any(-1) | torch.isposinf(x).any(-1) | ~torch.isfinite(x).any(-1)
        # Error rows go through the pipeline as all-zero logits; the caller overwrites their outputs.
        x = x.masked_fill(errors.unsqueeze(-1), 0.0)

        ranked = [i for i, r in enumerate(rows) if rank_all or r.needs_ranking]
        ranked_idx = host_built(ranked, torch.int64, device)
        order = torch.sort(x[ranked_idx], dim=-1, descending=True, stable=True).indices  # [m, V]

        keep = torch.ones_like(x, dtype=torch.bool)
        limited = [j for j, i in enumerate(ranked) if rows[i].rank_limit is not None]
        if limited:
            j_idx = host_built(limited, torch.int64, device)
            limits = host_built([rows[ranked[j]].rank_limit for j in limited], torch.int64, device)
            sub_order = order[j_idx]
            ranks = torch.arange(vocab_size, device=device).expand_as(sub_order)
            keep_sorted = ranks < limits.unsqueeze(-1)
            keep[ranked_idx[j_idx]] = torch.zeros_like(keep_sorted).scatter_(1, sub_order, keep_sorted)

        # Greedy rows process their logprobs at T = 1; tiny temperatures are clamped to float32's
        # smallest normal so that the max logit's 0 / T stays 0 (never 0 / 0).
        tiny = torch.finfo(torch.float32).tiny
        temperatures = host_built(
            [max(r.temperature, tiny) if r.temperature > 0 else 1.0 for r in rows], torch.float32, device
        )
        scaled = (x - x.amax(dim=-1, keepdim=True)) / temperatures.unsqueeze(-1)
        scaled = scaled.masked_fill(~keep, -math.inf)
        self._top_p(scaled, rows, ranked, ranked_idx, order)
        logprobs = torch.log_softmax(scaled, dim=-1)
        probs = torch.softmax(scaled, dim=-1)
        return ProcessedLogits(x, logprobs, probs, errors, ranked_idx, order)

    @staticmethod
    def _ban(x: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        vocab_size = x.shape[1]
        row_ids, token_ids = [], []
        for i, row in enumerate(rows):
            for t in row.banned_token_ids:
                if not 0 <= t < vocab_size:
                    raise ValueError(f"row {i}: banned token id {t} is outside the vocabulary [0, {vocab_size})")
                row_ids.append(i)
                token_ids.append(t)
        if row_ids:
            # A Python scalar would be copied from pageable memory (a stream sync on CUDA); a filled
            # 0-d device tensor is one kernel.
            x.index_put_(
                (host_built(row_ids, torch.int64, x.device), host_built(token_ids, torch.int64, x.device)),
                x.new_full((), -math.inf),
            )

    @staticmethod
    def _top_p(
        scaled: torch.Tensor,
        rows: Sequence[SamplingRow],
        ranked: list[int],
        ranked_idx: torch.Tensor,
        order: torch.Tensor,
    ) -> None:
        """Masks, in place, the tokens each top-p row drops; integer mass, so exact and order-free."""
        nucleus = [j for j, i in enumerate(ranked) if rows[i].top_p < 1]
        if not nucleus:
            return
        device = scaled.device
        j_idx = host_built(nucleus, torch.int64, device)
        row_idx = ranked_idx[j_idx]
        sub_order = order[j_idx]
        sub = scaled[row_idx]
        masses = integer_masses(torch.softmax(sub, dim=-1)).gather(1, sub_order)
        mass_before = torch.cumsum(masses, dim=-1) - masses
        # mass_before < top_p · 2³¹ ⇔ mass_before < ceil(top_p · 2³¹) for integers; rank 0 is always kept.
        limits = host_built([math.ceil(rows[ranked[j]].top_p * (1 << MASS_BITS)) for j in nucleus], torch.int64, device)
        keep_sorted = mass_before < limits.unsqueeze(-1)
        keep = torch.zeros_like(keep_sorted).scatter_(1, sub_order, keep_sorted)
        scaled[row_idx] = sub.masked_fill(~keep, -math.inf)
