"""Indexer scoring and top-k selection for decode (spec §3.7; the model's ``model/deepseek_v41/indexer.py``
``Indexer.scores_quantized`` + ``candidate_mask`` + ``select_entries``, as ``TorchAttention.select`` and
``Attention.restrict_to_candidates`` use them). Reference: ``kernels.reference.indexer_select``.

Two kernels, one query row per request (rows of one batch share nothing, so no key is reused):

1. ``_score_kernel``: score[r, j] = Σ_h relu(q[r,h]·k[j]) · w[r,h] for j < visible[r], −∞ after,
   reading the FP4 index keys straight from the paged pool (entry j at block_tables[r, j // epb],
   offset j % epb: 64 bytes of packed e2m1 + 4 e8m0 scales). Programs take tiles of BLOCK_N entries
   of one row, interleaved (tile split, split + num_splits, …) so rows shorter than the caller's width
   balance; tiles past the visible entries only write −∞. Per 32-channel scale group g the keys'
   e2m1 codes become e4m3 bytes by a bit shuffle (code · 2^-6, exact), then f16 (compiled: PTX on
   4-byte loads, two cvt.f16x2.e4m3x2 per 4 bytes; the interpreter: Triton ops on int32 words), and one
   [BLOCK_N, 32] × [32, H] tensor-core product gives Σ_c code·q; the e8m0 scale multiplies that
   [BLOCK_N, H] result (one FMA per entry, head and group instead of one per key element). The
   query enters as q / Q_h with Q_h the power of two ≤ max|q[h]| (exact in f16 for FP4-rounded
   queries), and Q_h moves into w (relu(Q_h·x) = Q_h·relu(x)). Products are exact and the sums
   fp32, so scores differ from the reference's einsum by summation order only. Options: candidate
   block mask (uint8 [R, ceil(W/CB)]) to score only inside, and the level-1 block maxima (the
   newest visible block forced to +∞) written for the candidate source.
2. ``kernels/indexer_topk.py``: per row, the k best finite scores with ties to the lower index, as
   ascending indices (level 2) or a mask (level 1's candidate blocks).

Graph-safe: every size comes from the caller's width; positions and tables are device tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.device import num_sms
from kernels.indexer_topk import select_topk

# e2m1 s|eem → e4m3 s|0eem|00 (the same number times 2^-6), four bytes at once, then two f16 pairs.
_ASM_EVEN = tl.constexpr("""{
.reg .b32 t, u;
.reg .b16 l, h;
and.b32 t, $2, 0x07070707;
shl.b32 t, t, 2;
and.b32 u, $2, 0x08080808;
shl.b32 u, u, 4;
or.b32 t, t, u;
mov.b32 {l, h}, t;
cvt.rn.f16x2.e4m3x2 $0, l;
cvt.rn.f16x2.e4m3x2 $1, h;
}""")
_ASM_ODD = tl.constexpr("""{
.reg .b32 t, u;
.reg .b16 l, h;
shr.b32 t, $2, 2;
and.b32 t, t, 0x1C1C1C1C;
and.b32 u, $2, 0x80808080;
or.b32 t, t, u;
mov.b32 {l, h}, t;
cvt.rn.f16x2.e4m3x2 $0, l;
cvt.rn.f16x2.e4m3x2 $1, h;
}""")
_GROUP = 32  # channels per e8m0 key scale (model/deepseek_v41/quant.py INDEXER_BLOCK)


@triton.jit
def _q_half(q_row, heads, h_ok, q_stride_h, inv_q, g, parity: tl.constexpr, dot_ty: tl.constexpr):
    """Channels 32g + 2c + parity (c < 16) of every head, over Q_h: [16, BLOCK_H] in the dot type."""
    c = tl.arange(0, 16)
    ptrs = q_row + heads[None, :] * q_stride_h + (32 * g + 2 * c + parity)[:, None]
    return (tl.load(ptrs, mask=h_ok[None, :], other=0.0).to(tl.float32) * inv_q[None, :]).to(dot_ty)


@triton.jit
def _group(
    acc,
    entry,
    ok,
    g,
    scale_bytes,
    q_even,
    q_odd,
    HALF: tl.constexpr,
    WORDS: tl.constexpr,
    ASM: tl.constexpr,
    dot_ty: tl.constexpr,
    precision: tl.constexpr,
):
    """acc [BLOCK_N, H] += scale_g · Σ_{c in group g} code · q: bytes 16g … 16g+15 of each entry.

    ASM (compiled only): bytes, 4-byte aligned entries, dequantised by PTX. WORDS: ``entry`` points at
    int32 words (4-byte aligned pool) and ``scale_bytes`` is the entry's scale word. Otherwise bytes.
    """
    if ASM:
        # Four packed bytes per register straight from a 4-byte load; PTX turns them into f16 pairs.
        # is_pure=False keeps the asm on the loaded layout (f16 then moves to the MMA layout through
        # shared memory): cheaper than Triton's choice of shuffling the bytes first (23 vs 26 SASS
        # warp-instructions per entry).
        ptrs = tl.multiple_of(entry[:, None] + 16 * g + tl.arange(0, 16)[None, :], [4, 4])  # 4-byte loads
        b = tl.load(ptrs)  # u8 [BLOCK_N, 16]
        lo = tl.inline_asm_elementwise(_ASM_EVEN, "=r,=r,r", [b], dtype=tl.float16, is_pure=False, pack=4)
        hi = tl.inline_asm_elementwise(_ASM_ODD, "=r,=r,r", [b], dtype=tl.float16, is_pure=False, pack=4)
        sb = tl.load(entry + HALF + g).to(tl.int32)
    else:
        if WORDS:
            wd = tl.load(entry[:, None] + 4 * g + tl.arange(0, 4)[None, :])  # [BLOCK_N, 4]
            # e2m1 s|eem → e4m3 s|0eem|00 (the same number times 2^-6; 0.5 lands on the e4m3 subnormal
            # 2^-7), four codes per word at once: low nibbles (even channels), then high nibbles.
            lo_w = ((wd & 0x07070707) << 2) | ((wd & 0x08080808) << 4)
            hi_w = ((wd >> 2) & 0x1C1C1C1C) | (wd & -0x7F7F7F80)  # -0x7F7F7F80 = 0x80808080
            shifts = 8 * tl.arange(0, 4)[None, None, :]
            lo8 = tl.reshape((lo_w[:, :, None] >> shifts) & 255, [lo_w.shape[0], 16])  # byte 4i+k = word i, byte k
            hi8 = tl.reshape((hi_w[:, :, None] >> shifts) & 255, [hi_w.shape[0], 16])
            sb = (scale_bytes >> (8 * g)) & 255
        else:
            b = tl.load(entry[:, None] + 16 * g + tl.arange(0, 16)[None, :]).to(tl.int32)
            lo8 = ((b & 7) << 2) | ((b & 8) << 4)
            hi8 = ((b >> 2) & 28) | (b & 128)
            sb = tl.load(entry + HALF + g).to(tl.int32)
        lo = lo8.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dot_ty)
        hi = hi8.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(dot_ty)
    d = tl.dot(lo, q_even, input_precision=precision)
    d = tl.dot(hi, q_odd, d, input_precision=precision)
    scale = ((sb + 6) << 23).to(tl.float32, bitcast=True)  # 2^(sb−127) · 2^6, exact (also sb = 0)
    return acc + d * scale[:, None]


@triton.jit
def _block_max(sc, t, vis, blocks_ptr, blocks_row, num_blocks, BLOCK_N: tl.constexpr, CB: tl.constexpr):
    """Level-1 block scores of tile t: max of CB entries, +∞ for the newest visible block."""
    bm = tl.max(tl.reshape(sc, [BLOCK_N // CB, CB]), axis=1)
    bid = t * (BLOCK_N // CB) + tl.arange(0, BLOCK_N // CB)
    newest = tl.where(vis > 0, (vis - 1) // CB, -1)  # Triton's // truncates: guard vis = 0
    bm = tl.where(bid == newest, float("inf"), bm)
    tl.store(blocks_ptr + blocks_row + bid, bm, mask=bid < num_blocks)


@triton.jit(
    do_not_specialize=(
        "width",
        "num_tiles",
        "num_blocks",
        "tables_stride_r",
        "cand_stride_r",
        "scores_stride_r",
        "blocks_stride_r",
        "num_splits",
    )
)
def _score_kernel(
    q_ptr,
    w_ptr,
    pool_ptr,
    tables_ptr,
    pos_ptr,
    cand_ptr,
    scores_ptr,
    blocks_ptr,
    w_scale,
    num_heads,
    width,
    num_tiles,
    num_blocks,
    ratio,
    entries_per_block,
    q_stride_r,
    q_stride_h,
    w_stride_r,
    pool_stride_block,
    pool_stride_entry,
    tables_stride_r,
    cand_stride_r,
    scores_stride_r,
    blocks_stride_r,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    num_splits,
    CB: tl.constexpr,
    USE_CAND: tl.constexpr,
    BLOCK_MAX: tl.constexpr,
    WORDS: tl.constexpr,
    ASM: tl.constexpr,
    DOT_FP32: tl.constexpr,
    FOR_LOOPS: tl.constexpr,
):
    HALF: tl.constexpr = D // 2 // (4 if WORDS else 1)  # packed codes, in pool elements
    GROUPS: tl.constexpr = D // 32  # e8m0 scale groups
    dot_ty: tl.constexpr = tl.float32 if DOT_FP32 else tl.float16
    precision: tl.constexpr = "ieee" if DOT_FP32 else "tf32"  # f16 operands ignore it
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    heads = tl.arange(0, BLOCK_H)
    h_ok = heads < num_heads  # padded heads: q = 0 and w = 0
    n = tl.arange(0, BLOCK_N)

    # Q_h = 2^floor(log2 max|q[h]|) (1 for an all-zero or subnormal head); w' = w · Q_h.
    q_row = q_ptr + row * q_stride_r
    q_all = tl.load(q_row + heads[:, None] * q_stride_h + tl.arange(0, D)[None, :], mask=h_ok[:, None], other=0.0).to(
        tl.float32
    )  # [BLOCK_H, D]
    expo = (tl.max(tl.abs(q_all), axis=1).to(tl.int32, bitcast=True) >> 23) & 255
    expo = tl.where(expo == 0, 127, expo)
    q_pow2 = (expo << 23).to(tl.float32, bitcast=True)
    inv_q = ((254 - expo) << 23).to(tl.float32, bitcast=True)
    # (w · w_scale) rounds in fp32 as torch's ``w * w_scale`` (an fp32 tensor times a scalar cast to fp32).
    w = tl.load(w_ptr + row * w_stride_r + heads, mask=h_ok, other=0.0).to(tl.float32) * w_scale
    w = w * q_pow2  # [BLOCK_H]
    qe0 = _q_half(q_row, heads, h_ok, q_stride_h, inv_q, 0, 0, dot_ty)
    qo0 = _q_half(q_row, heads, h_ok, q_stride_h, inv_q, 0, 1, dot_ty)
    qe1, qo1, qe2, qo2, qe3, qo3 = qe0, qe0, qe0, qe0, qe0, qe0  # placeholders below GROUPS = 4
    if GROUPS > 1:
        qe1 = _q_half(q_row, heads, h_ok, q_stride_h, inv_q, 1, 0, dot_ty)
        qo1 = _q_half(q_row, heads, h_ok, q_stride_h, inv_q, 1, 1, dot_ty)
    if GROUPS > 2:
        qe2 = _q_half(q_row, heads, h_ok, q_stride_h, inv_q, 2, 0, dot_ty)
        qo2 = _q_half(q_row, heads, h_ok, q_stride_h, inv_q, 2, 1, dot_ty)
        qe3 = _q_half(q_row, heads, h_ok, q_stride_h, inv_q, 3, 0, dot_ty)
        qo3 = _q_half(q_row, heads, h_ok, q_stride_h, inv_q, 3, 1, dot_ty)

    pos = tl.load(pos_ptr + row).to(tl.int32)
    vis = tl.minimum(tl.maximum(pos + 1, 0) // ratio, width)  # ⌊(p+1)/r⌋, within the caller's width
    vis_tiles = tl.cdiv(vis, BLOCK_N)
    scores_row = row * scores_stride_r
    blocks_row = row * blocks_stride_r
    # Tiles split, split + num_splits, … below vis_tiles are scored, the rest of this program's only get −∞.
    # Compiled: for loops (Triton software-pipelines them); the interpreter needs Python ints for
    # range bounds, so it walks the same tiles with while loops.
    if FOR_LOOPS:
        for t in range(split, vis_tiles, num_splits):
            _score_tile(
                t,
                n,
                vis,
                width,
                num_blocks,
                row,
                tables_ptr,
                tables_stride_r,
                entries_per_block,
                pool_ptr,
                pool_stride_block,
                pool_stride_entry,
                cand_ptr,
                cand_stride_r,
                scores_ptr,
                scores_row,
                blocks_ptr,
                blocks_row,
                w,
                qe0,
                qo0,
                qe1,
                qo1,
                qe2,
                qo2,
                qe3,
                qo3,
                BLOCK_N,
                BLOCK_H,
                HALF,
                GROUPS,
                CB,
                USE_CAND,
                BLOCK_MAX,
                WORDS,
                ASM,
                dot_ty,
                precision,
            )
        rest = split + num_splits * tl.cdiv(tl.maximum(vis_tiles - split, 0), num_splits)  # first tile past them
        for t in range(rest, num_tiles, num_splits):
            _hidden_tile(
                t, n, vis, width, num_blocks, scores_ptr, scores_row, blocks_ptr, blocks_row, BLOCK_N, CB, BLOCK_MAX
            )
    else:
        t = split
        while t < vis_tiles:
            _score_tile(
                t,
                n,
                vis,
                width,
                num_blocks,
                row,
                tables_ptr,
                tables_stride_r,
                entries_per_block,
                pool_ptr,
                pool_stride_block,
                pool_stride_entry,
                cand_ptr,
                cand_stride_r,
                scores_ptr,
                scores_row,
                blocks_ptr,
                blocks_row,
                w,
                qe0,
                qo0,
                qe1,
                qo1,
                qe2,
                qo2,
                qe3,
                qo3,
                BLOCK_N,
                BLOCK_H,
                HALF,
                GROUPS,
                CB,
                USE_CAND,
                BLOCK_MAX,
                WORDS,
                ASM,
                dot_ty,
                precision,
            )
            t += num_splits
        while t < num_tiles:
            _hidden_tile(
                t, n, vis, width, num_blocks, scores_ptr, scores_row, blocks_ptr, blocks_row, BLOCK_N, CB, BLOCK_MAX
            )
            t += num_splits


@triton.jit
def _score_tile(
    t,
    n,
    vis,
    width,
    num_blocks,
    row,
    tables_ptr,
    tables_stride_r,
    entries_per_block,
    pool_ptr,
    pool_stride_block,
    pool_stride_entry,
    cand_ptr,
    cand_stride_r,
    scores_ptr,
    scores_row,
    blocks_ptr,
    blocks_row,
    w,
    qe0,
    qo0,
    qe1,
    qo1,
    qe2,
    qo2,
    qe3,
    qo3,
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HALF: tl.constexpr,
    GROUPS: tl.constexpr,
    CB: tl.constexpr,
    USE_CAND: tl.constexpr,
    BLOCK_MAX: tl.constexpr,
    WORDS: tl.constexpr,
    ASM: tl.constexpr,
    dot_ty: tl.constexpr,
    precision: tl.constexpr,
):
    """Scores (and block maxima) of the BLOCK_N entries of tile t, a tile with visible entries."""
    j = t * BLOCK_N + n
    ok = j < vis
    # Entries past the visible ones read block 0 (any block's bytes: their scores are masked), so
    # the key loads need no mask.
    blk = tl.load(tables_ptr + row * tables_stride_r + j // entries_per_block, mask=ok, other=0).to(tl.int64)
    entry = pool_ptr + blk * pool_stride_block + (j % entries_per_block) * pool_stride_entry  # [BLOCK_N]
    scale_word = tl.load(entry + HALF)  # WORDS: the 4 scale bytes; else unused
    acc = tl.zeros([BLOCK_N, BLOCK_H], tl.float32)
    acc = _group(acc, entry, ok, 0, scale_word, qe0, qo0, HALF, WORDS, ASM, dot_ty, precision)
    if GROUPS > 1:
        acc = _group(acc, entry, ok, 1, scale_word, qe1, qo1, HALF, WORDS, ASM, dot_ty, precision)
    if GROUPS > 2:
        acc = _group(acc, entry, ok, 2, scale_word, qe2, qo2, HALF, WORDS, ASM, dot_ty, precision)
        acc = _group(acc, entry, ok, 3, scale_word, qe3, qo3, HALF, WORDS, ASM, dot_ty, precision)
    sc = tl.sum(tl.maximum(acc, 0.0) * w[None, :], axis=1)  # [BLOCK_N]
    sc = tl.where(sc == 0.0, 0.0, sc)  # −0 → +0: the reference's sort treats them as equal
    sc = tl.where(ok, sc, float("-inf"))
    if USE_CAND:
        keep = tl.load(cand_ptr + row * cand_stride_r + j // CB, mask=ok, other=0)
        sc = tl.where(keep != 0, sc, float("-inf"))
    tl.store(scores_ptr + scores_row + j, sc, mask=j < width)
    if BLOCK_MAX:
        _block_max(sc, t, vis, blocks_ptr, blocks_row, num_blocks, BLOCK_N, CB)


@triton.jit
def _hidden_tile(
    t,
    n,
    vis,
    width,
    num_blocks,
    scores_ptr,
    scores_row,
    blocks_ptr,
    blocks_row,
    BLOCK_N: tl.constexpr,
    CB: tl.constexpr,
    BLOCK_MAX: tl.constexpr,
):
    """A tile without visible entries: −∞ scores and block maxima, no key read."""
    j = t * BLOCK_N + n
    sc = tl.full([BLOCK_N], float("-inf"), tl.float32)
    tl.store(scores_ptr + scores_row + j, sc, mask=j < width)
    if BLOCK_MAX:
        _block_max(sc, t, vis, blocks_ptr, blocks_row, num_blocks, BLOCK_N, CB)


def indexer_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    key_pool: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    width: int,
    *,
    candidates: torch.Tensor | None = None,
    block_max: bool = False,
    candidate_block_size: int = 8,
    block_n: int = 128,
    splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    asm: bool = True,
    dot_fp32: bool = False,
    w_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 scores [R, width] (−∞ past ⌊(pos+1)/ratio⌋ and outside ``candidates``) and, with
    ``block_max``, the level-1 block scores [R, ceil(width/CB)] (None otherwise).

    q [R, Hi, di] FP4-rounded index queries (fp32 or bf16, last dim contiguous); w [R, Hi] fp32, times
    (di·Hi)^-1/2 already or by ``w_scale`` here (the kernel's fp32 ``w * w_scale``: the bits of torch's, one
    launch fewer); key_pool uint8 [num_blocks, epb, di/2 + di/32] (``CacheEngine.entries(l)[1]``);
    block_tables [R, ≥ ceil(width/epb)] int32/int64, each row's own table; positions [R] (decode
    position p of the row); candidates uint8/bool [R, ceil(width/CB)] block mask or None (``candidate_blocks``
    converts the model's entry mask). ``asm`` (CUDA, 4-byte aligned pools) picks the PTX dequantisation;
    ``splits`` (default: ~4 programs per SM) programs share a row's tiles; ``dot_fp32`` (interpreter) uses
    fp32 operands instead of f16.
    """
    num_rows, num_heads, dim = q.shape
    cb = candidate_block_size
    if w_scale != 1.0 and w.dtype != torch.float32:
        raise ValueError(f"w_scale needs w in float32 (torch's product rounds in w's dtype), got {w.dtype}")
    if dim not in (32, 64, 128):
        raise ValueError(f"index_head_dim must be 32, 64 or 128, got q {tuple(q.shape)}")
    if key_pool.shape[-1] != dim // 2 + dim // _GROUP or key_pool.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError(f"key pool entries {tuple(key_pool.shape)} do not fit di {dim} (or a last dim is strided)")
    if block_n % cb or block_n & (block_n - 1):
        raise ValueError(f"block_n {block_n} must be a power of two and a multiple of {cb}")
    # Whole words when the pool allows (the cache's is: 68-byte keys in 4-byte aligned blocks).
    aligned = (
        key_pool.shape[-1] % 4 == 0
        and key_pool.stride(0) % 4 == 0
        and key_pool.stride(1) % 4 == 0
        and key_pool.data_ptr() % 4 == 0
    )
    asm = asm and aligned and q.is_cuda and not dot_fp32
    words = aligned and not asm
    pool = key_pool.view(torch.int32) if words else key_pool
    num_tiles = triton.cdiv(width, block_n)
    num_blocks = triton.cdiv(width, cb)
    scores = torch.empty(num_rows, width, dtype=torch.float32, device=q.device)
    blocks = torch.empty(num_rows, num_blocks, dtype=torch.float32, device=q.device) if block_max else None
    cand = candidates.view(torch.uint8) if candidates is not None and candidates.dtype == torch.bool else candidates
    block_tables = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    w = w if w.stride(-1) == 1 else w.contiguous()
    if splits is None:  # about four programs per SM, at most one tile each; a power of two (fewer grid shapes)
        splits = max(1, min(num_tiles, triton.cdiv(4 * num_sms(q.device, off_gpu=8), max(num_rows, 1))))
        splits = 1 << (splits.bit_length() - 1)
    if num_rows == 0 or width == 0:
        return scores, blocks
    _score_kernel[(num_rows, splits)](
        q,
        w,
        pool,
        block_tables,
        positions,
        scores if cand is None else cand,
        scores,
        scores if blocks is None else blocks,
        float(w_scale),
        num_heads,
        width,
        num_tiles,
        num_blocks,
        ratio,
        key_pool.shape[1],
        q.stride(0),
        q.stride(1),
        w.stride(0),
        pool.stride(0),
        pool.stride(1),
        block_tables.stride(0),
        0 if cand is None else cand.stride(0),
        scores.stride(0),
        0 if blocks is None else blocks.stride(0),
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        D=dim,
        BLOCK_N=block_n,
        num_splits=splits,
        CB=cb,
        USE_CAND=cand is not None,
        BLOCK_MAX=block_max,
        WORDS=words,
        ASM=asm,
        DOT_FP32=dot_fp32,
        FOR_LOOPS=q.is_cuda,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return scores, blocks


def indexer_select(
    q: torch.Tensor,
    w: torch.Tensor,
    key_pool: torch.Tensor,
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    ratio: int,
    width: int,
    *,
    index_topk: int = 512,
    candidates: torch.Tensor | None = None,
    candidate_source: bool = False,
    candidate_block_size: int = 8,
    candidate_topk_blocks: int = 2048,
    select_width: int | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One index layer's decode selection: (entries int32 [R, min(index_topk, width)] ascending, −1
    padded; the candidate blocks to carry on, uint8 [R, ceil(width/CB)] or None).

    The candidate source picks its blocks from its own (unmasked) scores and returns them; a layer
    given ``candidates`` scores only inside them and passes them on (``Attention.restrict_to_candidates``).
    Arguments as ``indexer_scores``; ``options`` go to it (block_n, splits, num_warps, dot_fp32, w_scale).
    ``select_width``: the entries' columns (``select_topk``'s ``out_width``; default min(index_topk, width)).
    """
    if candidate_source and candidates is not None:
        raise ValueError("the candidate source picks candidates; it does not take them")
    scores, blocks = indexer_scores(
        q,
        w,
        key_pool,
        block_tables,
        positions,
        ratio,
        width,
        candidates=candidates,
        block_max=candidate_source,
        candidate_block_size=candidate_block_size,
        **options,
    )
    if blocks is not None:
        candidates = select_topk(blocks, candidate_topk_blocks, as_mask=True)
    return select_topk(scores, index_topk, out_width=select_width), candidates


def candidate_entries(
    blocks: torch.Tensor, positions: torch.Tensor, ratio: int, width: int, candidate_block_size: int = 8
) -> torch.Tensor:
    """Block mask [R, ceil(W/CB)] → the model's entry mask bool [R, W] (``candidate_mask``'s form)."""
    visible = (positions.long() + 1).clamp_min(0) // ratio
    entries = blocks.bool().repeat_interleave(candidate_block_size, dim=-1)[:, :width]
    return entries & (torch.arange(width, device=blocks.device) < visible.unsqueeze(-1))


def candidate_blocks(entries: torch.Tensor, candidate_block_size: int = 8) -> torch.Tensor:
    """The model's entry mask bool [R, W] → a uint8 block mask [R, ceil(W/CB)] (any entry kept)."""
    pad = -entries.shape[-1] % candidate_block_size
    padded = torch.nn.functional.pad(entries, (0, pad))
    return padded.unflatten(-1, (-1, candidate_block_size)).any(-1).to(torch.uint8)
