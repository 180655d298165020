"""The fused sampler's per-row passes over the logits (``kernels/sampler.py`` has the kernel, its
launcher and the design): banned loads, the order-preserving uint32 keys, the integer masses, and the
radix selects of the top-k cut, the top-p cut, the draw and the top-n ranks. Every helper reads the row
in id order, in chunks of ``BLOCK``; the kept set is ``key > cut_key or (key == cut_key and id < cut_id)``."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# The radix select settles RADIX_BITS key bits per pass: NUM_PIVOTS pivots, NUM_DIGITS passes per key.
RADIX_BITS = tl.constexpr(4)
NUM_PIVOTS = tl.constexpr(16)
NUM_DIGITS = tl.constexpr(8)


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
def _sum_exp(
    row_ptr,
    ban_ptr,
    num_tokens,
    err,
    m,
    temp,
    cut_key,
    cut_id,
    NUM_BANS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    acc = tl.zeros([BLOCK], tl.float32)
    for c in range(NUM_CHUNKS):
        offs = c * BLOCK + tl.arange(0, BLOCK)
        x = _load(row_ptr, ban_ptr, offs, num_tokens, err, NUM_BANS)
        kept = (_key(x) > cut_key) | ((_key(x) == cut_key) & (offs < cut_id))
        acc += tl.where(kept, _exp(tl.math.div_rn(x - m, temp), LIBDEVICE), 0.0)
    return tl.sum(acc, axis=0)


@triton.jit
def _select(
    row_ptr,
    ban_ptr,
    num_tokens,
    err,
    m,
    temp,
    total,
    cut_key,
    cut_id,
    target,
    MASS: tl.constexpr,
    NUM_BANS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    SEL_BLOCK: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
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
def _cut_ties(
    row_ptr,
    ban_ptr,
    num_tokens,
    err,
    m,
    temp,
    total,
    cut_key,
    cut_id,
    target,
    v,
    MASS: tl.constexpr,
    NUM_BANS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
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
        tie_mass = tl.max(
            _masses(
                _value(v + tl.zeros([1], tl.uint32)),
                m,
                temp,
                total,
                cut_key,
                cut_id,
                tl.zeros([1], tl.int32),
                LIBDEVICE,
            ),
            axis=0,
        )  # > 0 when found
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
def _top_logprobs(
    row_ptr,
    ban_ptr,
    num_tokens,
    err,
    m,
    temp,
    cut_key,
    cut_id,
    log_total,
    top_ids_ptr,
    top_lp_ptr,
    NUM_TOP: tl.constexpr,
    TOP_POW2: tl.constexpr,
    NUM_BANS: tl.constexpr,
    BLOCK: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    SEL_BLOCK: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS_POW2: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """The NUM_TOP best ranks (banned logit descending, ties → lower id) and their processed logprobs."""
    all_key = tl.zeros([], tl.uint32)
    if NUM_TOP < num_tokens:
        v, found = _select(
            row_ptr,
            ban_ptr,
            num_tokens,
            err,
            m,
            temp,
            1.0,
            all_key,
            num_tokens,
            NUM_TOP,
            False,
            NUM_BANS,
            BLOCK,
            NUM_CHUNKS,
            SEL_BLOCK,
            LIBDEVICE,
        )
        top_key, top_id = _cut_ties(
            row_ptr,
            ban_ptr,
            num_tokens,
            err,
            m,
            temp,
            1.0,
            all_key,
            num_tokens,
            NUM_TOP,
            v,
            False,
            NUM_BANS,
            BLOCK,
            NUM_CHUNKS,
            GROUP,
            GROUPS_POW2,
            LIBDEVICE,
        )
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
