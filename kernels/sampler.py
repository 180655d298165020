"""The fused sampler: one program per logits row reproduces ``services.worker.sampler.Sampler``.

Per row, in the CPU sampler's order: bans → -inf, top-k (the forced and the user's, as one rank limit),
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
``services.worker.sampler.Sampler`` (``sampling_params`` builds this kernel's tensors from its rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.device import upload
from services.worker.philox import DrawCase
from services.worker.sampler import SamplerOutput

MASS_SCALE = float(1 << 31)  # a probability p is worth floor(p · 2³¹) integer units
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
# The radix select settles RADIX_BITS key bits per pass: NUM_PIVOTS pivots, NUM_DIGITS passes per key.
RADIX_BITS = tl.constexpr(4)
NUM_PIVOTS = tl.constexpr(16)
NUM_DIGITS = tl.constexpr(8)
DRAW_GROUP = 8  # chunks per partial sum of the two-level scans (the draw, the tie cuts)
MAX_TOP_LOGPROBS = 64  # the top-n ranking compares n × n pairs in registers


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
def _load(row_ptr, ban_ptr, offs, num_tokens, err, NUM_BANS: tl.constexpr):
    """Banned logits of one chunk, fp32 [BLOCK]: lanes past the vocabulary -inf, error rows all 0."""
    ok = offs < num_tokens
    x = tl.load(row_ptr + offs, mask=ok, other=float("-inf")).to(tl.float32)
    for b in tl.static_range(NUM_BANS):  # padding −1 matches no token
        x = tl.where(offs == tl.load(ban_ptr + b), float("-inf"), x)
    x = tl.where(x == 0.0, 0.0, x)  # −0 → +0: the CPU sort ranks them as ties
    return tl.where(err & ok, 0.0, x)


@triton.jit
def _key(x):
    """Order-preserving uint32 key of a non-NaN float: a < b ⇔ key(a) < key(b) (after −0 → +0)."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, bits ^ 0xFFFFFFFF, bits | 0x80000000)  # (~ breaks the interpreter)


@triton.jit
def _value(key):
    """Inverse of ``_key``."""
    bits = tl.where((key >> 31) != 0, key & 0x7FFFFFFF, key ^ 0xFFFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _exp(s, LIBDEVICE: tl.constexpr):
    if LIBDEVICE:
        return libdevice.exp(s)  # ~1 ulp, like torch's; the interpreter has no libdevice (numpy's exp)
    else:
        return tl.exp(s)


@triton.jit
def _masses(x, m, temp, total, cut_key, cut_id, offs, LIBDEVICE: tl.constexpr):
    """floor(softmax · 2³¹) as int64 of the kept tokens (0 elsewhere); one op sequence for every pass."""
    kept = (_key(x) > cut_key) | ((_key(x) == cut_key) & (offs < cut_id))
    e = _exp(tl.math.div_rn(x - m, temp), LIBDEVICE)
    return tl.where(kept, tl.floor(tl.math.div_rn(e, total) * 2147483648.0).to(tl.int64), 0)


@triton.jit
def _sum_exp(row_ptr, ban_ptr, num_tokens, err, m, temp, cut_key, cut_id,
             NUM_BANS: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, LIBDEVICE: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(NUM_CHUNKS):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = _load(row_ptr, ban_ptr, offs, num_tokens, err, NUM_BANS)
        kept = (_key(x) > cut_key) | ((_key(x) == cut_key) & (offs < cut_id))
        acc += tl.where(kept, _exp(tl.math.div_rn(x - m, temp), LIBDEVICE), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _select(row_ptr, ban_ptr, num_tokens, err, m, temp, total, cut_key, cut_id, target,
            MASS: tl.constexpr, NUM_BANS: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
            SEL_BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Largest key v with W(key ≥ v) ≥ target, W = count (MASS false) or integer mass of kept tokens.

    Returns (v, found): found is false when even W(all) < target (then nothing is cut).
    """
    prefix = tl.zeros([], tl.uint32)
    digits = tl.arange(0, NUM_PIVOTS).to(tl.uint32)
    found = True
    for p in tl.static_range(NUM_DIGITS):
        shift = RADIX_BITS * (NUM_DIGITS - 1 - p)
        pivots = prefix + (digits << shift)  # [16]; W(key ≥ pivots[0]) ≥ target by induction
        acc = tl.zeros([NUM_PIVOTS], tl.int64)
        if MASS:
            # [SEL_BLOCK, 16] partial sums stay in registers across the row (one cross-thread
            # reduction per pass, not per chunk); SEL_BLOCK ≤ the threads, so ≤ 16 int64 per thread.
            part = tl.zeros([SEL_BLOCK, NUM_PIVOTS], tl.int64)
            for c in range(NUM_CHUNKS * (BLOCK // SEL_BLOCK)):  # SEL_BLOCK divides BLOCK
                offs = c * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
                x = _load(row_ptr, ban_ptr, offs, num_tokens, err, NUM_BANS)
                w = _masses(x, m, temp, total, cut_key, cut_id, offs, LIBDEVICE)
                part += tl.where(_key(x)[:, None] >= pivots[None, :], w[:, None], 0)
            acc = tl.sum(part, axis=0)
        else:
            # Counts: a histogram of this digit over the keys inside the prefix's bucket, plus the
            # keys above the bucket (they count for every pivot).
            hist = tl.zeros([NUM_PIVOTS], tl.int32)
            num_above = tl.zeros([4 * BLOCK], tl.int32)
            for c in range((NUM_CHUNKS + 3) // 4):  # 4 chunks per histogram: fewer block-wide combines
                offs = c * (4 * BLOCK) + tl.arange(0, 4 * BLOCK)
                key = _key(_load(row_ptr, ban_ptr, offs, num_tokens, err, NUM_BANS))
                ok = offs < num_tokens
                if p > 0:
                    bucket = prefix >> (shift + RADIX_BITS)
                    num_above += (ok & ((key >> (shift + RADIX_BITS)) > bucket)).to(tl.int32)
                    ok = ok & ((key >> (shift + RADIX_BITS)) == bucket)
                hist += tl.histogram(((key >> shift) & (NUM_PIVOTS - 1)).to(tl.int32), NUM_PIVOTS, mask=ok)
            # W(key ≥ pivot j) = above + Σ_{d ≥ j} hist[d]
            acc = (tl.sum(num_above, axis=0) + tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist).to(tl.int64)
        if p == 0:
            found = tl.max(acc, axis=0) >= target  # acc[0] = W(all)
        # W(key ≥ pivot) falls with the pivot: the last pivot that still reaches the target.
        j = tl.maximum(tl.sum((acc >= target).to(tl.int32), axis=0) - 1, 0)
        prefix = prefix + (j.to(tl.uint32) << shift)
    return prefix, found


@triton.jit
def _cut_ties(row_ptr, ban_ptr, num_tokens, err, m, temp, total, cut_key, cut_id, target, v,
              MASS: tl.constexpr, NUM_BANS: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr,
              GROUP: tl.constexpr, GROUPS_POW2: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The new (cut_key, cut_id) once ``_select`` found v: ties at v kept in id order while the weight
    of the higher ranks stays below the target (ranks < k; mass before < ceil(top_p · 2³¹))."""
    group_ids = tl.arange(0, GROUPS_POW2)
    ties_per_group = tl.zeros([GROUPS_POW2], tl.int32)  # kept ties (an id prefix of all ties) per group
    above = tl.zeros([BLOCK], tl.int64)
    for g in range((NUM_CHUNKS + GROUP - 1) // GROUP):
        ties = tl.zeros([BLOCK], tl.int32)
        for i in range(GROUP):
            offs = (g * GROUP + i) * BLOCK + tl.arange(0, BLOCK)
            x = _load(row_ptr, ban_ptr, offs, num_tokens, err, NUM_BANS)
            key = _key(x)
            kept = ((key > cut_key) | ((key == cut_key) & (offs < cut_id))) & (offs < num_tokens)
            if MASS:
                w = _masses(x, m, temp, total, cut_key, cut_id, offs, LIBDEVICE)
            else:
                w = kept.to(tl.int64)
            above += tl.where(key > v, w, 0)
            ties += (kept & (key == v)).to(tl.int32)
        ties_per_group = tl.where(group_ids == g, tl.sum(ties, axis=0), ties_per_group)
    rest = target - tl.sum(above, axis=0)  # > 0: v is the last value the target needs
    num_ties = tl.sum(ties_per_group, axis=0)
    if MASS:
        tie_mass = tl.max(_masses(_value(v + tl.zeros([1], tl.uint32)), m, temp, total, cut_key, cut_id,
                                  tl.zeros([1], tl.int32), LIBDEVICE), axis=0)  # > 0 when found
        num_keep = tl.minimum((rest + tie_mass - 1) // tl.maximum(tie_mass, 1), num_ties).to(tl.int32)
    else:
        num_keep = rest.to(tl.int32)
    new_id = num_tokens
    if num_keep < num_ties:  # the id of the tie at index num_keep is the first one dropped
        group = tl.sum((tl.cumsum(ties_per_group, axis=0) <= num_keep).to(tl.int32), axis=0)
        seen = tl.sum(tl.where(group_ids < group, ties_per_group, 0), axis=0)  # ties before the chunk
        for i in range(GROUP):
            offs = (group * GROUP + i) * BLOCK + tl.arange(0, BLOCK)
            key = _key(_load(row_ptr, ban_ptr, offs, num_tokens, err, NUM_BANS))
            tie = ((key > cut_key) | ((key == cut_key) & (offs < cut_id))) & (offs < num_tokens) & (key == v)
            index = seen + tl.cumsum(tie.to(tl.int32), axis=0) - 1  # the tie's index among all ties
            new_id = tl.minimum(new_id, tl.min(tl.where(tie & (index == num_keep), offs, num_tokens), axis=0))
            seen += tl.sum(tie.to(tl.int32), axis=0)
    new_id = tl.where(v == cut_key, tl.minimum(new_id, cut_id), new_id)
    return v, new_id


@triton.jit
def _top_logprobs(row_ptr, ban_ptr, num_tokens, err, m, temp, cut_key, cut_id, log_total, top_ids_ptr, top_lp_ptr,
                  NUM_TOP: tl.constexpr, TOP_POW2: tl.constexpr, NUM_BANS: tl.constexpr, BLOCK: tl.constexpr,
                  NUM_CHUNKS: tl.constexpr, SEL_BLOCK: tl.constexpr, GROUP: tl.constexpr,
                  GROUPS_POW2: tl.constexpr, LIBDEVICE: tl.constexpr):
    """The NUM_TOP best ranks (banned logit descending, ties → lower id) and their processed logprobs."""
    all_key = tl.zeros([], tl.uint32)
    if NUM_TOP < num_tokens:
        v, found = _select(row_ptr, ban_ptr, num_tokens, err, m, temp, 1.0, all_key, num_tokens, NUM_TOP,
                           False, NUM_BANS, BLOCK, NUM_CHUNKS, SEL_BLOCK, LIBDEVICE)
        top_key, top_id = _cut_ties(row_ptr, ban_ptr, num_tokens, err, m, temp, 1.0, all_key, num_tokens, NUM_TOP, v,
                                    False, NUM_BANS, BLOCK, NUM_CHUNKS, GROUP, GROUPS_POW2, LIBDEVICE)
    else:
        top_key = all_key
        top_id = num_tokens
    # Exactly NUM_TOP ids pass the cut: compact them, unordered, into the output row.
    running = tl.zeros([], tl.int32)
    for c in range(NUM_CHUNKS):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        key = _key(_load(row_ptr, ban_ptr, offs, num_tokens, err, NUM_BANS))
        top = ((key > top_key) | ((key == top_key) & (offs < top_id))) & (offs < num_tokens)
        slot = running + tl.cumsum(top.to(tl.int32), axis=0) - 1
        tl.store(top_ids_ptr + slot, offs.to(tl.int64), mask=top & (slot < NUM_TOP))
        running += tl.sum(top.to(tl.int32), axis=0)
    tl.debug_barrier()  # the compacted ids are read back by other threads
    lanes = tl.arange(0, TOP_POW2)
    ids = tl.load(top_ids_ptr + lanes, mask=lanes < NUM_TOP, other=num_tokens).to(tl.int32)
    x = _load(row_ptr, ban_ptr, ids, num_tokens, err, NUM_BANS)
    key = _key(x)
    # rank = how many of the others rank higher; padding lanes (id = V, key of -inf) rank last.
    higher = (key[None, :] > key[:, None]) | ((key[None, :] == key[:, None]) & (ids[None, :] < ids[:, None]))
    rank = tl.sum(higher.to(tl.int32), axis=1)
    kept = (key > cut_key) | ((key == cut_key) & (ids < cut_id))
    lp = tl.where(kept & (err == 0), tl.math.div_rn(x - m, temp) - log_total, float("-inf"))
    tl.debug_barrier()  # every lane has read its id before any is overwritten
    ok = lanes < NUM_TOP
    tl.store(top_ids_ptr + rank, ids.to(tl.int64), mask=ok)
    tl.store(top_lp_ptr + rank, lp, mask=ok)


@triton.jit
def _sampler_kernel(
    logits_ptr, row_stride, num_tokens,
    temp_ptr, rank_limit_ptr, mass_limit_ptr, seed_ptr, pos_ptr, ban_ptr, ban_stride,
    token_ptr, logprob_ptr, error_ptr, top_ids_ptr, top_lp_ptr, case,
    NUM_BANS: tl.constexpr, BLOCK: tl.constexpr, NUM_CHUNKS: tl.constexpr, SEL_BLOCK: tl.constexpr,
    GROUP: tl.constexpr, GROUPS_POW2: tl.constexpr, NUM_TOP: tl.constexpr, TOP_POW2: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * row_stride  # [V] fp32 or bf16
    ban_row = ban_ptr + row * ban_stride  # [NUM_BANS] int32, −1 padded

    # Pass 1: max and argmax of the banned logits (ties → lowest id), and the error flags.
    no_error = num_tokens < 0
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
        v, found = _select(row_ptr, ban_row, num_tokens, err, m, temp, 1.0, cut_key, cut_id, target,
                           False, NUM_BANS, BLOCK, NUM_CHUNKS, SEL_BLOCK, LIBDEVICE)
        cut_key, cut_id = _cut_ties(row_ptr, ban_row, num_tokens, err, m, temp, 1.0, cut_key, cut_id, target, v,
                                    False, NUM_BANS, BLOCK, NUM_CHUNKS, GROUP, GROUPS_POW2, LIBDEVICE)
    total = _sum_exp(row_ptr, ban_row, num_tokens, err, m, temp, cut_key, cut_id,
                     NUM_BANS, BLOCK, NUM_CHUNKS, LIBDEVICE)
    if mass_limit > 0:
        v, found = _select(row_ptr, ban_row, num_tokens, err, m, temp, total, cut_key, cut_id, mass_limit,
                           True, NUM_BANS, BLOCK, NUM_CHUNKS, SEL_BLOCK, LIBDEVICE)
        if found:
            cut_key, cut_id = _cut_ties(row_ptr, ban_row, num_tokens, err, m, temp, total, cut_key, cut_id,
                                        mass_limit, v, True, NUM_BANS, BLOCK, NUM_CHUNKS, GROUP, GROUPS_POW2, LIBDEVICE)
            total = _sum_exp(row_ptr, ban_row, num_tokens, err, m, temp, cut_key, cut_id,
                             NUM_BANS, BLOCK, NUM_CHUNKS, LIBDEVICE)

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

    # log_softmax of the processed row at the token: s − log Σ exp(s) (the kept max has s = 0).
    if LIBDEVICE:
        log_total = libdevice.log(total)
    else:
        log_total = tl.log(total)
    x_tok = _load(row_ptr, ban_row, token + tl.zeros([1], tl.int32), num_tokens, err, NUM_BANS)
    s_tok = tl.sum(tl.math.div_rn(x_tok - m, temp), axis=0)
    tl.store(token_ptr + row, tl.where(err, 0, token).to(tl.int64))
    tl.store(logprob_ptr + row, tl.where(err, float("-inf"), s_tok - log_total))
    tl.store(error_ptr + row, err)
    if NUM_TOP > 0:
        _top_logprobs(row_ptr, ban_row, num_tokens, err, m, temp, cut_key, cut_id, log_total,
                      top_ids_ptr + row * NUM_TOP, top_lp_ptr + row * NUM_TOP, NUM_TOP, TOP_POW2, NUM_BANS, BLOCK,
                      NUM_CHUNKS, SEL_BLOCK, GROUP, GROUPS_POW2, LIBDEVICE)


@dataclass
class SamplingParams:
    """Per-row parameters as tensors (graph-safe: a captured step reads them in place)."""

    temperature: torch.Tensor  # [R] float32; 0 = greedy
    rank_limit: torch.Tensor  # [R] int32; min(forced top-k, top-k), 0 = off
    mass_limit: torch.Tensor  # [R] int64; ceil(top_p · 2³¹), 0 = off (top_p = 1)
    seed: torch.Tensor  # [R] int64; the seed mod 2⁶⁴ as two's complement
    position: torch.Tensor  # [R] int64; the index of the token being produced
    banned: torch.Tensor  # [R, B] int32 token ids, −1 padded (B may be 0)


def top_p_mass_limit(top_p: torch.Tensor) -> torch.Tensor:
    """ceil(top_p · 2³¹) as int64, 0 where top_p = 1 (off); ``top_p`` float64 like the CPU sampler's."""
    limit = torch.ceil(top_p.to(torch.float64) * MASS_SCALE).to(torch.int64)
    return torch.where(top_p < 1, limit, torch.zeros_like(limit))


def sampling_params(rows: Sequence, device: torch.device | str | None = None,
                    num_bans: int | None = None) -> SamplingParams:
    """Tensors for ``rows`` (``services.worker.sampler.SamplingRow``); ``num_bans`` pads the ban lists."""
    width = max((len(r.banned_token_ids) for r in rows), default=0) if num_bans is None else num_bans
    banned = torch.full((len(rows), width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        if len(r.banned_token_ids) > width:
            raise ValueError(f"row {i} bans {len(r.banned_token_ids)} tokens, more than num_bans={width}")
        banned[i, : len(r.banned_token_ids)] = torch.tensor(r.banned_token_ids, dtype=torch.int32)
    seeds = [(r.seed & ((1 << 64) - 1)) - ((1 << 64) if r.seed & (1 << 63) else 0) for r in rows]
    top_p = torch.tensor([r.top_p for r in rows], dtype=torch.float64)

    def up(host: torch.Tensor) -> torch.Tensor:  # enqueued, not synchronised (kernels/device.py)
        return host if device is None else upload(host, device)

    return SamplingParams(
        temperature=up(torch.tensor([r.temperature for r in rows], dtype=torch.float32)),
        rank_limit=up(torch.tensor([r.rank_limit or 0 for r in rows], dtype=torch.int32)),
        mass_limit=up(top_p_mass_limit(top_p)),
        seed=up(torch.tensor(seeds, dtype=torch.int64)),
        position=up(torch.tensor([r.position for r in rows], dtype=torch.int64)),
        banned=up(banned),
    )


def sample(logits: torch.Tensor, params: SamplingParams, num_logprobs: int = 0,
           case: DrawCase | int = DrawCase.SAMPLE, block: int | None = None, num_warps: int | None = None,
           ) -> SamplerOutput:
    """logits [R, V] fp32/bf16 (last dim contiguous) → the CPU sampler's ``SamplerOutput``.

    ``num_logprobs`` is the batch's top-n width (the CPU sampler's w = min(max num_logprobs, V)); every
    row gets that many ranks. Graph-safe: outputs are allocated here, never read back on the host.
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [R, V] with a contiguous last dim, got {tuple(logits.shape)}")
    num_rows, num_tokens = logits.shape
    width = min(num_logprobs, num_tokens)
    if width > MAX_TOP_LOGPROBS:
        raise ValueError(f"the kernel ranks at most {MAX_TOP_LOGPROBS} top logprobs in registers, asked {width}")
    device = logits.device
    out = SamplerOutput(
        token_ids=torch.empty(num_rows, dtype=torch.int64, device=device),
        logprobs=torch.empty(num_rows, dtype=torch.float32, device=device),
        top_token_ids=torch.empty(num_rows, width, dtype=torch.int64, device=device),
        top_logprobs=torch.empty(num_rows, width, dtype=torch.float32, device=device),
        errors=torch.empty(num_rows, dtype=torch.bool, device=device),
    )
    if num_rows == 0:
        return out
    block = block or min(1024, triton.next_power_of_2(num_tokens))
    num_chunks = triton.cdiv(num_tokens, block)
    num_warps = num_warps or (8 if block >= 1024 else 4)
    banned = params.banned
    _sampler_kernel[(num_rows,)](
        logits, logits.stride(0), num_tokens,
        params.temperature, params.rank_limit, params.mass_limit, params.seed, params.position,
        banned, banned.stride(0) if banned.shape[1] else 0,
        out.token_ids, out.logprobs, out.errors, out.top_token_ids, out.top_logprobs, int(case),
        NUM_BANS=banned.shape[1], BLOCK=block, NUM_CHUNKS=num_chunks,
        SEL_BLOCK=min(block, 32 * num_warps),
        GROUP=DRAW_GROUP, GROUPS_POW2=triton.next_power_of_2(triton.cdiv(num_chunks, DRAW_GROUP)),
        NUM_TOP=width, TOP_POW2=triton.next_power_of_2(max(width, 1)), LIBDEVICE=logits.is_cuda,
        num_warps=num_warps,
    )
    return out
