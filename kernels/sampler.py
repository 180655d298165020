"""The fused sampler: one program per logits row reproduces ``services.worker.sampling.sampler.Sampler``.

Per row, in the CPU sampler's order: bans → -inf (and the structured-output token bitmask's disallowed tokens,
in pass 0), top-k (the forced and the user's, as one rank limit),
temperature, top-p on integer masses, renormalisation, then the Philox draw (or the greedy argmax),
the chosen token's logprob and the top-n logprobs. Every pass reads the row (L2/HBM) in id order, in
chunks of ``BLOCK``; nothing is sorted:

- pass 1: max, argmax (ties → lowest id), error flags (NaN, +inf, nothing finite), per lane;
- top-k: the k-th largest value by a 4-bit radix select on the order-preserving uint32 keys (8 passes,
  each a 16-bin histogram of the digit inside the current bucket), then one pass that cuts the tied
  tokens by id (ties → lower id);
- sum₁ = Σ exp(s) over what top-k keeps, s = (x − max) / T;
- top-p: the same radix select on Σ floor(exp(s)/sum₁ · 2³¹) (16 int64 pivot sums per pass), giving
  the value where the nucleus ends and, among its ties, the id cut;
- sum₂ over the final set, then the masses floor(exp(s)/sum₂ · 2³¹): one pass for the total and the
  per-group sums, and one group's cumulative sums for the drawn token (a two-level scan);
- top-n (``num_logprobs`` > 0 for the batch): the n-th rank by the count select, the n ids compacted
  into the output row, ranked in registers.

The kept set is always ``key > cut_key or (key == cut_key and id < cut_id)``: a prefix of the rank order
(logit descending, ties to the lower id), exactly the CPU sampler's stable sort.

Exactness: the Philox bits, the rank order, the tie rules, the integer mass limit ceil(top_p · 2³¹),
the threshold (bits · total) >> 31 and the integer arithmetic after the masses are bit-identical to the
CPU sampler. The fp32 softmax cannot be: exp and the summation order differ from torch's (CPU or CUDA)
by a few ulp, so p differs by a relative δ ≈ 10⁻⁶ at most. Consequences, and the only ones:
(1) a draw differs only when the threshold lies within ~δ · 2³¹ (a few hundred to ~2,000 units of 2⁻³¹)
of the drawn token's cumulative-mass boundary: p ≈ 10⁻⁶ per draw; (2) a top-p cut moves by one rank
when ceil(top_p · 2³¹) lies that close to the boundary's cumulative mass; the dropped/kept tail token
then changes sum₂ by its own p, so the draw differs with probability ≈ that p and logprobs by ≈ p.
Greedy ids, top-k cuts, top-n ids and error flags depend on comparisons of the logits only: exact.

Graph-safe: every per-row parameter is a tensor; no host synchronisation. Reference:
``services.worker.sampling.sampler.Sampler`` (``sampling_tensors`` builds this kernel's tensors from its rows).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.device import upload
from kernels.philox import DrawCase
from kernels.sampler_output import SamplerOutput
from kernels.sampler_select import (
    _cut_ties,
    _key,
    _load,
    _masses,
    _select,
    _sum_exp,
    _top_logprobs,
)

MASS_SCALE = float(1 << 31)  # a probability p is worth floor(p · 2³¹) integer units
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
DRAW_GROUP = 8  # chunks per partial sum of the two-level scans (the draw, the tie cuts)
MAX_TOP_LOGPROBS = 64  # the top-n ranking compares n × n pairs in registers
TOP_BUCKETS = (4, 20, MAX_TOP_LOGPROBS)
"""Top-n widths the kernel ranks (NUM_TOP is a constexpr): a batch's width rounded up to the first that holds it
(20 is the API's most; the first w ranks are the same at any wider n)."""


@triton.jit
def _philox_bits(seed, stream):
    """Top 31 bits of Philox4x32-10's first word; key = seed (int64 holding u64), counter = (stream, 0)."""
    k0 = seed.to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c0 = stream.to(tl.uint32)
    c1 = (stream >> 32).to(tl.uint32)
    c2 = c0 * 0  # uint32 zeros
    c3 = c0 * 0
    for r in tl.static_range(10):
        if r > 0:  # Random123 bumps the key before every round after the first
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
        hi0 = tl.umulhi(c0, PHILOX_M0)
        lo0 = c0 * PHILOX_M0
        hi1 = tl.umulhi(c2, PHILOX_M1)
        lo1 = c2 * PHILOX_M1
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return (c0 >> 1).to(tl.int64)


@triton.jit
def _div64(y, r, LIBDEVICE: tl.constexpr):
    """IEEE float64 division (the CPU's)."""
    if LIBDEVICE:
        return libdevice.div_rn(y, r)
    else:
        return y / r  # the interpreter's numpy division


@triton.jit(do_not_specialize=("case",))
def _sampler_kernel(
    logits_ptr,
    row_stride,
    num_tokens,
    temp_ptr,
    rank_limit_ptr,
    mass_limit_ptr,
    seed_ptr,
    pos_ptr,
    ban_ptr,
    ban_stride,
    forced_ptr,
    history_ptr,
    penalty_ptr,
    min_p_ptr,
    counts_ptr,
    prompt_ptr,
    counts_stride,
    mask_ptr,
    mask_stride,
    scratch_ptr,
    token_ptr,
    logprob_ptr,
    error_ptr,
    top_ids_ptr,
    top_lp_ptr,
    case,
    NUM_BANS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    SEL_BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    NUM_TOP: tl.constexpr,
    TOP_POW2: tl.constexpr,
    PROCESS: tl.constexpr,
    HAS_MASK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride  # [V] fp32 or bf16
    ban_row = ban_ptr + row * ban_stride  # [NUM_BANS] int32, −1 padded
    no_error = num_tokens < 0

    if PROCESS:
        # Pass 0: penalties and min-p (services/worker/sampling/penalties.py's arithmetic) into the row's fp32
        # scratch, which every later pass reads instead of the logits; a row without them is copied as is.
        scratch_row = scratch_ptr + row.to(tl.int64) * num_tokens
        slot = tl.load(history_ptr + row)
        has = slot >= 0
        slot64 = tl.maximum(slot, 0).to(tl.int64)
        rep = tl.load(penalty_ptr + row * 3)
        freq = tl.load(penalty_ptr + row * 3 + 1)
        pres = tl.load(penalty_ptr + row * 3 + 2)
        lane_top = tl.full([BLOCK], float("-inf"), tl.float32)
        for c in range(NUM_CHUNKS):
            offs = c * BLOCK + tl.arange(0, BLOCK)
            ok = offs < num_tokens
            x = _load(row_ptr, ban_row, offs, num_tokens, no_error, NUM_BANS)
            if HAS_MASK:  # the structured-output token bitmask: bit t of word w allows token 32·w + t
                words = tl.load(mask_ptr + row.to(tl.int64) * mask_stride + (offs >> 5), mask=ok, other=0)
                x = tl.where(((words >> (offs & 31)) & 1) != 0, x, float("-inf"))
            cnt = tl.load(counts_ptr + slot64 * counts_stride + offs, mask=ok & has, other=0)
            in_prompt = tl.load(prompt_ptr + slot64 * counts_stride + offs, mask=ok & has, other=0)
            y = x.to(tl.float64)
            seen = (cnt > 0) | (in_prompt != 0)
            y = tl.where(seen, tl.where(y > 0, _div64(y, rep, LIBDEVICE), y * rep), y)
            y = y - freq * cnt.to(tl.float64)
            y = y - pres * (cnt > 0).to(tl.float64)
            x = tl.where(has, y.to(tl.float32), x)
            tl.store(scratch_row + offs, x, mask=ok)
            lane_top = tl.maximum(lane_top, x)
        min_p_log = tl.load(min_p_ptr + row)
        if min_p_log > float("-inf"):
            tl.debug_barrier()
            top = tl.max(lane_top, axis=0)
            t0 = tl.load(temp_ptr + row)
            t_min_p = tl.where(t0 == 0.0, 1.0, tl.maximum(t0, 1.1754943508222875e-38))
            for c in range(NUM_CHUNKS):
                offs = c * BLOCK + tl.arange(0, BLOCK)
                ok = offs < num_tokens
                x = tl.load(scratch_row + offs, mask=ok, other=float("-inf"))
                x = tl.where(tl.math.div_rn(x - top, t_min_p) < min_p_log, float("-inf"), x)
                tl.store(scratch_row + offs, x, mask=ok)
        tl.debug_barrier()
        row_ptr = scratch_row

    # Pass 1: max and argmax of the banned logits (ties → lowest id), and the error flags.
    # Per-lane running values, reduced once after the loop: a lane's arg is its first id of its max
    # (chunks go up in id order), so the lowest id among the lanes holding the row max is the argmax.
    lane_max = tl.full([BLOCK], float("-inf"), tl.float32)
    lane_arg = tl.zeros([BLOCK], tl.int32)
    lane_bad = tl.zeros([BLOCK], tl.int1)
    lane_finite = tl.zeros([BLOCK], tl.int1)
    for c in range(NUM_CHUNKS):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = _load(row_ptr, ban_row, offs, num_tokens, no_error, NUM_BANS)
        lane_bad = lane_bad | (x != x) | (x == float("inf"))
        lane_finite = lane_finite | ((x > float("-inf")) & (x < float("inf")))
        better = x > lane_max  # strictly: an earlier id keeps a tie
        lane_arg = tl.where(better, offs, lane_arg)
        lane_max = tl.where(better, x, lane_max)
    m = tl.max(lane_max, axis=0)
    arg = tl.min(tl.where(lane_max == m, lane_arg, num_tokens), axis=0)
    bad = tl.max(lane_bad.to(tl.int32), axis=0)
    finite = tl.max(lane_finite.to(tl.int32), axis=0)
    err = (bad > 0) | (finite == 0)  # error rows continue as all-zero logits, like the CPU sampler
    m = tl.where(err, 0.0, m)
    arg = tl.where(err, 0, arg)

    t = tl.load(temp_ptr + row)
    greedy = t == 0.0
    # Greedy rows process their logprobs at T = 1; tiny temperatures clamp to float32's smallest normal.
    temp = tl.where(greedy, 1.0, tl.maximum(t, 1.1754943508222875e-38))
    rank_limit = tl.load(rank_limit_ptr + row)
    mass_limit = tl.load(mass_limit_ptr + row)

    # Kept = key > cut_key or (key == cut_key and id < cut_id); (0, V) keeps every token.
    cut_key = tl.zeros([], tl.uint32)
    cut_id = num_tokens
    if (rank_limit > 0) & (rank_limit < num_tokens):
        target = rank_limit.to(tl.int64)
        v, found = _select(
            row_ptr,
            ban_row,
            num_tokens,
            err,
            m,
            temp,
            1.0,
            cut_key,
            cut_id,
            target,
            False,
            NUM_BANS,
            BLOCK,
            NUM_CHUNKS,
            SEL_BLOCK,
            LIBDEVICE,
        )
        cut_key, cut_id = _cut_ties(
            row_ptr,
            ban_row,
            num_tokens,
            err,
            m,
            temp,
            1.0,
            cut_key,
            cut_id,
            target,
            v,
            False,
            NUM_BANS,
            BLOCK,
            NUM_CHUNKS,
            GROUP,
            GROUPS_POW2,
            LIBDEVICE,
        )
    total = _sum_exp(
        row_ptr, ban_row, num_tokens, err, m, temp, cut_key, cut_id, NUM_BANS, BLOCK, NUM_CHUNKS, LIBDEVICE
    )
    if mass_limit > 0:
        v, found = _select(
            row_ptr,
            ban_row,
            num_tokens,
            err,
            m,
            temp,
            total,
            cut_key,
            cut_id,
            mass_limit,
            True,
            NUM_BANS,
            BLOCK,
            NUM_CHUNKS,
            SEL_BLOCK,
            LIBDEVICE,
        )
        if found:
            cut_key, cut_id = _cut_ties(
                row_ptr,
                ban_row,
                num_tokens,
                err,
                m,
                temp,
                total,
                cut_key,
                cut_id,
                mass_limit,
                v,
                True,
                NUM_BANS,
                BLOCK,
                NUM_CHUNKS,
                GROUP,
                GROUPS_POW2,
                LIBDEVICE,
            )
            total = _sum_exp(
                row_ptr, ban_row, num_tokens, err, m, temp, cut_key, cut_id, NUM_BANS, BLOCK, NUM_CHUNKS, LIBDEVICE
            )

    token = arg
    if not greedy:
        # The draw: integer masses, their total and per-group sums (GROUP chunks each: one
        # cross-thread reduction per group), then the chosen group's cumulative sums chunk by chunk.
        group_ids = tl.arange(0, GROUPS_POW2)
        per_group = tl.zeros([GROUPS_POW2], tl.int64)
        for g in range((NUM_CHUNKS + GROUP - 1) // GROUP):
            acc = tl.zeros([BLOCK], tl.int64)
            for i in range(GROUP):
                offs = (g * GROUP + i) * BLOCK + tl.arange(0, BLOCK)
                x = _load(row_ptr, ban_row, offs, num_tokens, err, NUM_BANS)
                acc += _masses(x, m, temp, total, cut_key, cut_id, offs, LIBDEVICE)
            per_group = tl.where(group_ids == g, tl.sum(acc, axis=0), per_group)
        bits = _philox_bits(tl.load(seed_ptr + row), 3 * tl.load(pos_ptr + row) + case)
        # bits < 2³¹ and the total < 2³², so the product fits int64; threshold < total.
        threshold = (bits * tl.sum(per_group, axis=0)) >> 31
        # The token is the first id whose inclusive cumulative mass exceeds the threshold, i.e. the
        # number of ids whose cumulative mass is at most the threshold (all ids of earlier groups).
        group = tl.sum((tl.cumsum(per_group, axis=0) <= threshold).to(tl.int32), axis=0)
        running = tl.sum(tl.where(group_ids < group, per_group, 0), axis=0)
        token = group * GROUP * BLOCK
        for i in range(GROUP):  # ids past the vocabulary weigh 0: never at or below it
            offs = (group * GROUP + i) * BLOCK + tl.arange(0, BLOCK)
            x = _load(row_ptr, ban_row, offs, num_tokens, err, NUM_BANS)
            w = _masses(x, m, temp, total, cut_key, cut_id, offs, LIBDEVICE)
            token += tl.sum((running + tl.cumsum(w, axis=0) <= threshold).to(tl.int32), axis=0)
            running += tl.sum(w, axis=0)

    # A forced token replaces the draw; its logprob is the processed row's, −inf where it was not kept.
    forced = tl.load(forced_ptr + row)
    token = tl.where(forced >= 0, forced.to(token.dtype), token)
    # log_softmax of the processed row at the token: s − log Σ exp(s) (the kept max has s = 0).
    if LIBDEVICE:
        log_total = libdevice.log(total)
    else:
        log_total = tl.log(total)
    x_tok = _load(row_ptr, ban_row, token + tl.zeros([1], tl.int32), num_tokens, err, NUM_BANS)
    kept_tok = (_key(x_tok) > cut_key) | ((_key(x_tok) == cut_key) & (token < cut_id))
    s_tok = tl.sum(tl.where(kept_tok, tl.math.div_rn(x_tok - m, temp), float("-inf")), axis=0)
    tl.store(token_ptr + row, tl.where(err, 0, token).to(tl.int64))
    tl.store(logprob_ptr + row, tl.where(err, float("-inf"), s_tok - log_total))
    tl.store(error_ptr + row, err)
    if NUM_TOP > 0:
        _top_logprobs(
            row_ptr,
            ban_row,
            num_tokens,
            err,
            m,
            temp,
            cut_key,
            cut_id,
            log_total,
            top_ids_ptr + row * NUM_TOP,
            top_lp_ptr + row * NUM_TOP,
            NUM_TOP,
            TOP_POW2,
            NUM_BANS,
            BLOCK,
            NUM_CHUNKS,
            SEL_BLOCK,
            GROUP,
            GROUPS_POW2,
            LIBDEVICE,
        )


@dataclass
class SamplingTensors:
    """Per-row parameters as tensors (graph-safe: a captured step reads them in place)."""

    temperature: torch.Tensor  # [R] float32; 0 = greedy
    rank_limit: torch.Tensor  # [R] int32; min(forced top-k, top-k), 0 = off
    mass_limit: torch.Tensor  # [R] int64; ceil(top_p · 2³¹), 0 = off (top_p = 1)
    seed: torch.Tensor  # [R] int64; the seed mod 2⁶⁴ as two's complement
    position: torch.Tensor  # [R] int64; the index of the token being produced
    banned: torch.Tensor  # [R, B] int32 token ids, −1 padded (B may be 0)
    forced: torch.Tensor  # [R] int64; the token output instead of the draw, −1 = draw
    history: torch.Tensor  # [R] int32; the row's token-count slot, −1 = no penalties
    penalty: torch.Tensor  # [R, 3] float64; (repetition, frequency, presence) at their float32 values
    min_p: torch.Tensor  # [R] float32; float32(log(min_p)), −inf = off
    process: bool  # some row has penalties or min-p: the kernel's pass 0 runs (host-known)
    needs_counts: bool  # some row has penalties: ``sample`` needs the token counts (host-known)


def top_p_mass_limit(top_p: torch.Tensor) -> torch.Tensor:
    """ceil(top_p · 2³¹) as int64, 0 where top_p = 1 (off); ``top_p`` float64 like the CPU sampler's."""
    limit = torch.ceil(top_p.to(torch.float64) * MASS_SCALE).to(torch.int64)
    return torch.where(top_p < 1, limit, torch.zeros_like(limit))


def sampling_tensors(
    rows: Sequence, device: torch.device | str | None = None, num_bans: int | None = None
) -> SamplingTensors:
    """Tensors for ``rows`` (``services.worker.sampling.sampler.SamplingRow``); ``num_bans`` pads the ban lists.

    Host work per step, so per row only list comprehensions over plain attributes: one ``torch.tensor`` per
    parameter (none per row), the ban table only when a row bans, and each tensor uploaded without a sync.
    ceil(top_p · 2³¹) in Python floats is ``top_p_mass_limit``'s float64 product: scaling by 2³¹ is exact.
    """
    num_rows = len(rows)
    ban_lists = [r.banned_token_ids for r in rows]
    longest = max(map(len, ban_lists), default=0)
    # Padded to a power of two by default: NUM_BANS is a constexpr, so the kernel's variants stay few.
    width = (triton.next_power_of_2(longest) if longest else 0) if num_bans is None else num_bans
    if longest > width:
        i = next(i for i, b in enumerate(ban_lists) if len(b) > width)
        raise ValueError(f"row {i} bans {len(ban_lists[i])} tokens, more than num_bans={width}")
    if longest == 0:
        banned = torch.full((num_rows, width), -1, dtype=torch.int32)
    else:  # one build of the padded table
        banned = torch.tensor([list(b) + [-1] * (width - len(b)) for b in ban_lists], dtype=torch.int32)
    mask64, sign = (1 << 64) - 1, 1 << 63
    seeds = [s & mask64 for s in (r.seed for r in rows)]
    seeds = [s - (1 << 64) if s & sign else s for s in seeds]
    # min(forced top-k, top-k) over those set (top_k <= 0 and forced_top_k None are off), 0 = off.
    rank_limits = [
        (k if f is None or k < f else f) if k > 0 else (f or 0) for k, f in ((r.top_k, r.forced_top_k) for r in rows)
    ]
    mass_limits = [math.ceil(p * MASS_SCALE) if p < 1 else 0 for p in (r.top_p for r in rows)]
    forced = [-1 if r.forced_token_id is None else r.forced_token_id for r in rows]
    history = [-1 if r.history is None or not r.has_penalties else r.history for r in rows]
    penalty = [(r.repetition_penalty, r.frequency_penalty, r.presence_penalty) for r in rows]
    min_p = [-math.inf if r.min_p <= 0 else math.log(r.min_p) for r in rows]

    def up(host: torch.Tensor) -> torch.Tensor:  # enqueued, not synchronised (kernels/device.py)
        return host if device is None else upload(host, device)

    return SamplingTensors(
        temperature=up(torch.tensor([r.temperature for r in rows], dtype=torch.float32)),
        rank_limit=up(torch.tensor(rank_limits, dtype=torch.int32)),
        mass_limit=up(torch.tensor(mass_limits, dtype=torch.int64)),
        seed=up(torch.tensor(seeds, dtype=torch.int64)),
        position=up(torch.tensor([r.position for r in rows], dtype=torch.int64)),
        banned=up(banned),
        forced=up(torch.tensor(forced, dtype=torch.int64)),
        history=up(torch.tensor(history, dtype=torch.int32)),
        # float32 values (penalties.py), widened to float64 for the kernel's arithmetic
        penalty=up(torch.tensor(penalty, dtype=torch.float32).reshape(num_rows, 3).to(torch.float64)),
        min_p=up(torch.tensor(min_p, dtype=torch.float32)),
        process=any(h >= 0 for h in history) or any(t > -math.inf for t in min_p),
        needs_counts=any(h >= 0 for h in history),
    )


def sample(
    logits: torch.Tensor,
    params: SamplingTensors,
    num_logprobs: int = 0,
    case: DrawCase | int = DrawCase.SAMPLE,
    block: int | None = None,
    num_warps: int | None = None,
    counts: tuple[torch.Tensor, torch.Tensor] | None = None,
    token_bitmask: torch.Tensor | None = None,
    launch: bool = True,
) -> SamplerOutput:
    """logits [R, V] fp32/bf16 (last dim contiguous) → the CPU sampler's ``SamplerOutput``.

    ``num_logprobs`` is the batch's top-n width (the CPU sampler's w = min(max num_logprobs, V)); every
    row gets that many ranks (the kernel ranks w rounded up to a power of two, a constexpr: the first w of
    them are the same). ``counts``: the penalties' (output int32 [S, V], prompt bool [S, V]) token counts
    (services/worker/sampling/token_counts.py), read in place; needed when a row has penalties.
    ``token_bitmask``: structured output's int32 [R, >= ceil(V / 32)] on the logits' device
    (services/worker/sampling/token_bitmask.py), applied in pass 0 after the bans (which it then runs). Graph-safe:
    outputs are allocated here, never read back on the host. ``launch=False`` compiles this call's variant of the
    kernel without running it (``JITFunction.warmup``; in parallel under Triton's ``AsyncCompileMode``) and
    returns the outputs unwritten.
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [R, V] with a contiguous last dim, got {tuple(logits.shape)}")
    num_rows, num_tokens = logits.shape
    width = min(num_logprobs, num_tokens)
    if width > MAX_TOP_LOGPROBS:
        raise ValueError(f"the kernel ranks at most {MAX_TOP_LOGPROBS} top logprobs in registers, asked {width}")
    device = logits.device
    ranked = min(next(b for b in TOP_BUCKETS if b >= width), num_tokens) if width else 0
    out = SamplerOutput(
        token_ids=torch.empty(num_rows, dtype=torch.int64, device=device),
        logprobs=torch.empty(num_rows, dtype=torch.float32, device=device),
        top_token_ids=torch.empty(num_rows, ranked, dtype=torch.int64, device=device),
        top_logprobs=torch.empty(num_rows, ranked, dtype=torch.float32, device=device),
        errors=torch.empty(num_rows, dtype=torch.bool, device=device),
    )
    if num_rows == 0:
        return _first_ranks(out, width)
    block = block or min(1024, triton.next_power_of_2(num_tokens))
    num_chunks = triton.cdiv(num_tokens, block)
    num_warps = num_warps or (8 if block >= 1024 else 4)
    banned = params.banned
    if token_bitmask is not None and (
        token_bitmask.dtype != torch.int32
        or token_bitmask.dim() != 2
        or token_bitmask.shape[0] != num_rows
        or token_bitmask.shape[1] * 32 < num_tokens
        or token_bitmask.stride(-1) != 1
    ):
        raise ValueError(
            f"the token bitmask must be int32 [{num_rows}, >= {triton.cdiv(num_tokens, 32)}] with a contiguous last dim"
        )
    process = params.process or token_bitmask is not None
    if process:
        if counts is None:
            if params.needs_counts:
                raise ValueError("rows with penalties need the token counts")
            counts = (torch.zeros(1, num_tokens, dtype=torch.int32, device=device),) * 2
        output_counts, prompt_seen = counts
        if output_counts.shape[1] != num_tokens or prompt_seen.shape != output_counts.shape:
            raise ValueError(f"token counts must be [S, {num_tokens}], got {tuple(output_counts.shape)}")
        prompt_seen = prompt_seen.view(torch.uint8) if prompt_seen.dtype == torch.bool else prompt_seen
        scratch = torch.empty(num_rows, num_tokens, dtype=torch.float32, device=device)
    else:  # pass 0 is compiled out: any tensors stand in
        output_counts = prompt_seen = scratch = out.logprobs
    kernel = _sampler_kernel[(num_rows,)] if launch else functools.partial(_sampler_kernel.warmup, grid=(num_rows,))
    kernel(
        logits,
        logits.stride(0),
        num_tokens,
        params.temperature,
        params.rank_limit,
        params.mass_limit,
        params.seed,
        params.position,
        banned,
        banned.stride(0) if banned.shape[1] else 0,
        params.forced,
        params.history,
        params.penalty,
        params.min_p,
        output_counts,
        prompt_seen,
        output_counts.stride(0) if process else 0,
        token_bitmask if token_bitmask is not None else out.logprobs,  # a stand-in when compiled out
        token_bitmask.stride(0) if token_bitmask is not None else 0,
        scratch,
        out.token_ids,
        out.logprobs,
        out.errors,
        out.top_token_ids,
        out.top_logprobs,
        int(case),
        NUM_BANS=banned.shape[1],
        BLOCK=block,
        NUM_CHUNKS=num_chunks,
        SEL_BLOCK=min(block, 32 * num_warps),
        GROUP=DRAW_GROUP,
        GROUPS_POW2=triton.next_power_of_2(triton.cdiv(num_chunks, DRAW_GROUP)),
        NUM_TOP=ranked,
        TOP_POW2=triton.next_power_of_2(max(ranked, 1)),
        PROCESS=process,
        HAS_MASK=token_bitmask is not None,
        LIBDEVICE=logits.is_cuda,
        num_warps=num_warps,
    )
    return _first_ranks(out, width)


def _first_ranks(out: SamplerOutput, width: int) -> SamplerOutput:
    """``out`` with its top-n columns cut to the first ``width`` (dense, as ``SamplerOutput`` has them)."""
    if out.top_token_ids.shape[1] == width:
        return out
    top_ids, top_lp = out.top_token_ids[:, :width].contiguous(), out.top_logprobs[:, :width].contiguous()
    return dataclasses.replace(out, top_token_ids=top_ids, top_logprobs=top_lp)
