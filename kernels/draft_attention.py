"""The DSpark draft's block attention: one launch per stage for what the torch form does in about 40 ops.

A block of S slots (``model.deepseek_v41.draft_attention.DraftAttention``) attends, per head, over its W
context entries (the draft's ring: rotated and FP8-rounded when written) and its own S keys, all visible
to every slot (bidirectional), with one sink logit per head. Per block n and head h, one program:

    q     = rope(q_n,h)                          the block's queries, RoPE applied here (turns [S, P])
    k_own = fp8(rope(kv_n))                       the block's own K=V: RoPE, then ``fake_quant_fp8_e4m3``
    o     = softmax([q·window ; q·k_own ; sink] · scale) · [window ; k_own ; 0]
    out   = rope⁻¹(o)                            RoPE undone, as ``Attention.project_out`` does first

Channels are handled as (even, odd) pairs throughout (two strided loads), so the rotation of the last P
pairs needs no register shuffle: a pair (a, b) times the turn (c, d) is (a·c − b·d, a·d + b·c), the
product torch's complex multiply computes (``kernels.rmsnorm._rotate``); the inverse multiplies by (c, −d).
A rotated value is rounded to its tensor's dtype before use, as ``apply_rope``'s result is.

The FP8 rounding of the own keys is ``window_write``'s exact maths (a max, a power-of-two scale, one
rounding to the e4m3 grid) per 32-channel block, i.e. 16 pairs: equal to the torch form's bits for the same
rotated input. The softmax is an online one over key tiles (the window in BLOCK_T tiles, then the own
keys), started from the sink (running max = sink, denominator 1, accumulator 0), so the running max is
always finite; its fp32 sums differ from the torch form's in order only. Every program reads one block's
rows only, with tiles fixed by (W, S, head_dim), never by the number of blocks: a block's output does not
depend on which other blocks share the launch (batch invariance).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.quant_fp8 import _pow2_ceil, _round_to_e4m3_grid
from kernels.rmsnorm import _rotate

FP8_BLOCK = 32  # channels per FP8 scale (model.deepseek_v41.quant.FP8_CACHE_BLOCK): 16 pairs
MIN_DOT = 16  # the least M, N, K of a compiled tl.dot


@triton.jit
def _rope_pairs(
    even,
    odd,
    turn_ptr,
    slot_ok,
    ROPE_START: tl.constexpr,
    NUM_PAIRS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    HALF: tl.constexpr,
    INVERSE: tl.constexpr,
):
    """(even, odd) [BLOCK_S, HALF] with the last NUM_PAIRS pairs rotated by the slots' turns (fp32 pairs
    [S, P, 2] at turn_ptr, contiguous), by their conjugates when INVERSE."""
    pairs = tl.arange(0, HALF)
    rope = pairs >= ROPE_START
    slots = tl.arange(0, BLOCK_S)
    at = turn_ptr + slots[:, None] * (2 * NUM_PAIRS) + 2 * (pairs[None, :] - ROPE_START)
    ok = slot_ok[:, None] & rope[None, :]
    c = tl.load(at, mask=ok, other=1.0)
    d = tl.load(at + 1, mask=ok, other=0.0)
    if INVERSE:
        d = -d
    re, im = _rotate(even, odd, c, d)
    return tl.where(rope[None, :], re, even), tl.where(rope[None, :], im, odd)


@triton.jit
def _fp8_pairs(even, odd, BLOCK_S: tl.constexpr, HALF: tl.constexpr):
    """``fake_quant_fp8_e4m3`` of rows given as (even, odd) [BLOCK_S, HALF]: 16 pairs per 32-channel block."""
    groups: tl.constexpr = HALF // 16
    e3 = tl.reshape(even, (BLOCK_S, groups, 16))
    o3 = tl.reshape(odd, (BLOCK_S, groups, 16))
    amax = tl.max(tl.maximum(tl.abs(e3), tl.abs(o3)), axis=2)  # [BLOCK_S, groups]; exact in any order
    scale = _pow2_ceil(tl.maximum(amax, 1e-4) * (1.0 / 448.0))
    biased = (scale.to(tl.int32, bitcast=True) >> 23) & 255
    inv_scale = ((254 - biased) << 23).to(tl.float32, bitcast=True)
    e3 = _round_to_e4m3_grid(tl.minimum(tl.maximum(e3 * inv_scale[:, :, None], -448.0), 448.0)) * scale[:, :, None]
    o3 = _round_to_e4m3_grid(tl.minimum(tl.maximum(o3 * inv_scale[:, :, None], -448.0), 448.0)) * scale[:, :, None]
    return tl.reshape(e3, (BLOCK_S, HALF)), tl.reshape(o3, (BLOCK_S, HALF))


@triton.jit
def _softmax_step(m, l, acc_e, acc_o, logits, k_e, k_o):
    """One key tile of the online softmax: logits [BLOCK_S, T] (−inf where hidden), keys (k_e, k_o) [T, HALF]."""
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(logits - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc_e = acc_e * alpha[:, None] + tl.dot(p, k_e, input_precision="ieee")
    acc_o = acc_o * alpha[:, None] + tl.dot(p, k_o, input_precision="ieee")
    return m_new, l, acc_e, acc_o


@triton.jit
def _draft_attention_kernel(
    q_ptr,
    own_ptr,
    window_ptr,
    visible_ptr,
    turn_ptr,
    sink_ptr,
    out_ptr,
    scale,
    NUM_WINDOW: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_PAIRS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    # Every tensor contiguous: q/out [N, S, H, hd], own [N, S, hd], window [N, W, hd], visible [N, W],
    # turns [N, S, P, 2]. HALF = hd/2 pairs, of which the last NUM_PAIRS rotate.
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    HALF: tl.constexpr = HEAD_DIM // 2
    ROPE_START: tl.constexpr = HALF - NUM_PAIRS
    slots = tl.arange(0, BLOCK_S)
    slot_ok = slots < NUM_SLOTS
    pairs = tl.arange(0, HALF)
    turns = turn_ptr + n * (NUM_SLOTS * NUM_PAIRS * 2)

    q_at = q_ptr + ((n * NUM_SLOTS + slots[:, None]) * NUM_HEADS + h) * HEAD_DIM + 2 * pairs[None, :]
    q_e = tl.load(q_at, mask=slot_ok[:, None], other=0.0).to(tl.float32)
    q_o = tl.load(q_at + 1, mask=slot_ok[:, None], other=0.0).to(tl.float32)
    q_e, q_o = _rope_pairs(q_e, q_o, turns, slot_ok, ROPE_START, NUM_PAIRS, BLOCK_S, HALF, False)
    q_e = q_e.to(q_ptr.dtype.element_ty).to(tl.float32)  # apply_rope returns q's dtype
    q_o = q_o.to(q_ptr.dtype.element_ty).to(tl.float32)

    k_at = own_ptr + (n * NUM_SLOTS + slots[:, None]) * HEAD_DIM + 2 * pairs[None, :]
    k_e = tl.load(k_at, mask=slot_ok[:, None], other=0.0).to(tl.float32)
    k_o = tl.load(k_at + 1, mask=slot_ok[:, None], other=0.0).to(tl.float32)
    k_e, k_o = _rope_pairs(k_e, k_o, turns, slot_ok, ROPE_START, NUM_PAIRS, BLOCK_S, HALF, False)
    k_e, k_o = _fp8_pairs(
        k_e.to(own_ptr.dtype.element_ty).to(tl.float32), k_o.to(own_ptr.dtype.element_ty).to(tl.float32), BLOCK_S, HALF
    )

    # The sink as the softmax's first key: max = sink, denominator exp(sink − max) = 1, value 0.
    m = tl.zeros([BLOCK_S], dtype=tl.float32) + tl.load(sink_ptr + h).to(tl.float32)
    l = tl.full([BLOCK_S], 1.0, dtype=tl.float32)
    acc_e = tl.zeros([BLOCK_S, HALF], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_S, HALF], dtype=tl.float32)
    keys = tl.arange(0, BLOCK_T)
    for t0 in range(0, NUM_WINDOW, BLOCK_T):
        t = t0 + keys
        t_ok = t < NUM_WINDOW
        w_at = window_ptr + (n * NUM_WINDOW + t[:, None]) * HEAD_DIM + 2 * pairs[None, :]
        w_e = tl.load(w_at, mask=t_ok[:, None], other=0.0).to(tl.float32)
        w_o = tl.load(w_at + 1, mask=t_ok[:, None], other=0.0).to(tl.float32)
        seen = tl.load(visible_ptr + n * NUM_WINDOW + t, mask=t_ok, other=0) != 0
        dots = tl.dot(q_e, tl.trans(w_e), input_precision="ieee") + tl.dot(q_o, tl.trans(w_o), input_precision="ieee")
        logits = tl.where(seen[None, :], dots * scale, float("-inf"))
        m, l, acc_e, acc_o = _softmax_step(m, l, acc_e, acc_o, logits, w_e, w_o)
    dots = tl.dot(q_e, tl.trans(k_e), input_precision="ieee") + tl.dot(q_o, tl.trans(k_o), input_precision="ieee")
    logits = tl.where(slot_ok[None, :], dots * scale, float("-inf"))
    m, l, acc_e, acc_o = _softmax_step(m, l, acc_e, acc_o, logits, k_e, k_o)

    o_e = acc_e / l[:, None]
    o_o = acc_o / l[:, None]
    # sink_attention's output is cast to q's dtype before project_out's inverse RoPE.
    o_e = o_e.to(out_ptr.dtype.element_ty).to(tl.float32)
    o_o = o_o.to(out_ptr.dtype.element_ty).to(tl.float32)
    o_e, o_o = _rope_pairs(o_e, o_o, turns, slot_ok, ROPE_START, NUM_PAIRS, BLOCK_S, HALF, True)
    out_at = out_ptr + ((n * NUM_SLOTS + slots[:, None]) * NUM_HEADS + h) * HEAD_DIM + 2 * pairs[None, :]
    tl.store(out_at, o_e.to(out_ptr.dtype.element_ty), mask=slot_ok[:, None])
    tl.store(out_at + 1, o_o.to(out_ptr.dtype.element_ty), mask=slot_ok[:, None])


def draft_attention(
    q: torch.Tensor,
    own: torch.Tensor,
    window: torch.Tensor,
    visible: torch.Tensor,
    turns: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """N blocks of S slots: q [N, S, H, hd] (``wq_b`` output, not rotated), own [N, S, hd] (``kv_norm``
    output, not rotated nor rounded), window [N, W, hd] (the ring's entries: rotated, FP8-rounded; any float
    dtype), visible bool [N, W], turns fp32 [N, S, P, 2] (``torch.view_as_real`` of ``rope_turns``), sink [H]
    → the attention output with RoPE undone, q's dtype [N, S, H, hd] (``Attention.project``'s input).
    head_dim a power of two and a multiple of 32, the rotated channels whole 32-channel blocks' worth of pairs
    or fewer (2P ≤ head_dim)."""
    n, s, h, hd = q.shape
    w = window.shape[1]
    p = turns.shape[2]
    if hd % FP8_BLOCK or hd & (hd - 1) or 2 * p > hd:
        raise ValueError(
            f"draft_attention needs head_dim a power of two, a multiple of {FP8_BLOCK}, ≥ 2P; got head_dim {hd}, P {p}"
        )
    if (
        own.shape != (n, s, hd)
        or window.shape != (n, w, hd)
        or visible.shape != (n, w)
        or turns.shape != (n, s, p, 2)
        or sink.shape != (h,)
    ):
        raise ValueError(
            f"draft_attention: shapes q {tuple(q.shape)}, own {tuple(own.shape)}, window "
            f"{tuple(window.shape)}, visible {tuple(visible.shape)}, turns {tuple(turns.shape)}, "
            f"sink {tuple(sink.shape)}"
        )
    if turns.dtype != torch.float32 or visible.dtype != torch.bool:
        raise ValueError(f"draft_attention takes fp32 turns and bool visible, got {turns.dtype}, {visible.dtype}")
    q, own, window, visible, turns = (t.contiguous() for t in (q, own, window, visible, turns))
    out = torch.empty_like(q)
    if n == 0:
        return out
    block_s = max(MIN_DOT, triton.next_power_of_2(s))
    # Two fp32 key tiles [BLOCK_T, hd/2] live beside the accumulators. At V41's head (512, 8 warps, sm_90a) ptxas
    # spills ~1.5–2 KB a thread at 16 keys a tile and none at 32 (scripts/dev/compile_sm90.py, bf16 or fp32 q).
    block_t = max(MIN_DOT, min(64 if hd <= 128 else 32, triton.next_power_of_2(max(w, 1))))
    _draft_attention_kernel[(n, h)](
        q,
        own,
        window,
        visible,
        turns,
        sink,
        out,
        scale,
        NUM_WINDOW=w,
        NUM_SLOTS=s,
        NUM_HEADS=h,
        HEAD_DIM=hd,
        NUM_PAIRS=p,
        BLOCK_S=block_s,
        BLOCK_T=block_t,
        num_warps=4 if hd <= 128 else 8,
    )
    return out
