"""The KV source's compressor after its projection, fused: gather a group's members (this step's rows
or the state slot's fp32 partial rows), pool (ratio 2), RMSNorm, RoPE, FP4 and the write of the
compressed-KV entry; the index key ``k_norm(wk · latent)`` with RoPE and FP4; and the partial-row
writes (spec §3.6–3.7). Semantics, bytes and state are those of ``TorchAttention.write_groups`` (the
reference: services/worker/attention/torch_backend.py; pools as ``CacheEngine.write_entries`` / ``write_partial``
store them). The dense projections over all rows (``Compressor.project``, ratio 1's ``wkv``) stay
outside: they are [R, 5120] GEMMs.

One program takes BLOCK_E (16) entries (rows whose position closes a group). The latent is made
twice, CHUNK channels at a time: a first pass for its sum of squares, a second that normalises each
chunk, multiplies it into the index-key accumulator (a [BLOCK_E, CHUNK] × [CHUNK, di] tensor-core
product with a tile of ``wk``), splits it into (even, odd) channels (the pairing of both RoPE and the
FP4 packing), rotates it (the trailing chunks only), rounds it and stores its bytes; so no whole row
lives in registers. Every rounding the model makes in its activation dtype (bf16 on the GPU) is
repeated here at the same point, and fp contraction is off, so the elementwise maths is the
reference's operation for operation; what differs is summation order (norms, the wk product) and
the exp / cos / sin implementations (libdevice on the GPU, numpy in the interpreter).

Graph-safe: the grid depends on tensor shapes only and every index is read on the device. The
partial-row writes go to programs placed before the entry programs, except one per request: when a
ratio-2 group straddles the step (its first token is the cached position first−1), the tail row that
lands on the same partial row ((first−1) mod size) is written by that group's program after it has
read the row (a CTA barrier orders the two), so no read ever sees this step's write. This relies on
``rows`` listing every row whose position closes a group, as the scheduler's ``entry_writes`` do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels import invariance
from kernels.quant_fp8 import _pow2_ceil, _round_to_e4m3_grid


@triton.jit
def _act(x, ACT_BF16: tl.constexpr):
    """fp32 → the model's activation dtype and back (RNE on the GPU; the interpreter truncates)."""
    if ACT_BF16:
        x = x.to(tl.bfloat16).to(tl.float32)
    return x


@triton.jit
def _fp4_codes(xn):
    """fp32 values already divided by their scale → e2m1 codes (int32 0..15): clamp ±6, nearest
    magnitude with ties to the even code (≥ at the odd midpoints .75, 1.75, 3.5), sign bit for x < 0."""
    x = tl.minimum(tl.maximum(xn, -6.0), 6.0)
    a = tl.abs(x)
    code = (
        (a > 0.25).to(tl.int32)
        + (a >= 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a >= 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a >= 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return code | ((x < 0.0).to(tl.int32) << 3)


@triton.jit
def _fp4(xe, xo, ROWS: tl.constexpr, PAIRS: tl.constexpr, BLOCK_PAIRS: tl.constexpr, E4M3: tl.constexpr):
    """(even, odd) halves [ROWS, PAIRS] → (packed bytes [ROWS, PAIRS] uint8, scale bytes [ROWS, PAIRS/BLOCK_PAIRS]).

    A block is 2·BLOCK_PAIRS channels. E4M3: scale = e4m3_rne(max(amax, 6·2^-9) / 6) (compressed KV);
    else the e8m0 power of two pow2_ceil(max(amax, 6·2^-126) · fp32(1/6)) (index keys).
    """
    NB: tl.constexpr = PAIRS // BLOCK_PAIRS
    a = tl.maximum(tl.abs(xe), tl.abs(xo))
    amax = tl.max(tl.reshape(a, [ROWS, NB, BLOCK_PAIRS]), axis=2)  # [ROWS, NB]
    if E4M3:
        scale = _round_to_e4m3_grid(tl.div_rn(tl.maximum(amax, 0.01171875), 6.0))
        scale_byte = scale.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        scale = _pow2_ceil(tl.maximum(amax, 7.052861752969245e-38) * (1.0 / 6.0))
        scale_byte = ((scale.to(tl.int32, bitcast=True) >> 23) & 255).to(tl.uint8)
    full = tl.reshape(tl.broadcast_to(scale[:, :, None], [ROWS, NB, BLOCK_PAIRS]), [ROWS, PAIRS])
    packed = _fp4_codes(tl.div_rn(xe, full)) | (_fp4_codes(tl.div_rn(xo, full)) << 4)
    return packed.to(tl.uint8), scale_byte


@triton.jit
def _rope(xe, xo, start, freqs_ptr, pairs, NUM_PAIRS: tl.constexpr, ROPE_PAIRS: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Rotate pairs ≥ NUM_PAIRS − ROPE_PAIRS of (xe, xo) [ROWS, len(pairs)] by start · freqs; others unchanged.

    libdevice's cos/sin reduce any angle accurately; the interpreter has no libdevice (numpy's).
    """
    j = pairs - (NUM_PAIRS - ROPE_PAIRS)
    is_rope = j >= 0
    f = tl.load(freqs_ptr + tl.where(is_rope, j, 0), mask=is_rope, other=0.0)
    angle = start.to(tl.float32)[:, None] * f[None, :]  # the reference's fp32 product
    if LIBDEVICE:
        c = libdevice.cos(angle)
        s = libdevice.sin(angle)
    else:
        c = tl.cos(angle)
        s = tl.sin(angle)
    re = xe * c - xo * s
    im = xe * s + xo * c
    return tl.where(is_rope[None, :], re, xe), tl.where(is_rope[None, :], im, xo)


@triton.jit
def _chunk(
    c, v0, g0, v1, g1, ok, CHUNK: tl.constexpr, RATIO: tl.constexpr, ACT_BF16: tl.constexpr, LIBDEVICE: tl.constexpr
):
    """Channels c … c+CHUNK−1 of every entry's pre-norm latent, in the activation dtype, as fp32 [BLOCK_E, CHUNK].

    Ratio 2: v0/g0, v1/g1 [BLOCK_E] point at the members' value and gate rows (step rows or partial
    rows); the gate softmax over the 2 members then Σ value·weight, as the reference's separate ops
    (fp contraction is off for this kernel). Ratio 1: v0 points at the projected row.
    """
    cols = c + tl.arange(0, CHUNK)[None, :]
    m = ok[:, None]
    x0 = tl.load(v0[:, None] + cols, mask=m, other=0.0).to(tl.float32)
    if RATIO == 1:
        return x0
    gate0 = tl.load(g0[:, None] + cols, mask=m, other=0.0)
    x1 = tl.load(v1[:, None] + cols, mask=m, other=0.0)
    gate1 = tl.load(g1[:, None] + cols, mask=m, other=0.0)
    top = tl.maximum(gate0, gate1)
    if LIBDEVICE:
        e0 = libdevice.exp(gate0 - top)
        e1 = libdevice.exp(gate1 - top)
    else:
        e0 = tl.exp(gate0 - top)
        e1 = tl.exp(gate1 - top)
    total = e0 + e1
    return _act(x0 * tl.div_rn(e0, total) + x1 * tl.div_rn(e1, total), ACT_BF16)


@triton.jit
def _entry_chunk(
    c,
    k,
    v0,
    g0,
    v1,
    g1,
    ok,
    inv_rms,
    start,
    kv_row,
    norm_w_ptr,
    wk_tile,
    freqs_ptr,
    ROTATE: tl.constexpr,
    HD: tl.constexpr,
    CHUNK: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    RATIO: tl.constexpr,
    ACT_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    """Channels c … c+CHUNK−1: normalise, add wk · latent into k [BLOCK_E, DI], rotate (ROTATE), round
    to FP4 and store the packed bytes and e4m3 scales of the entries at kv_row [BLOCK_E]."""
    dot_ty = tl.float32 if DOT_FP32 else tl.bfloat16
    precision: tl.constexpr = "ieee" if DOT_FP32 else "tf32"  # bf16 operands ignore it
    chans = tl.arange(0, CHUNK)
    pairs = tl.arange(0, CHUNK // 2)
    x = _chunk(c, v0, g0, v1, g1, ok, CHUNK, RATIO, ACT_BF16, LIBDEVICE)
    latent = _act(tl.load(norm_w_ptr + c + chans).to(tl.float32)[None, :] * (x * inv_rms), ACT_BF16)
    k = tl.dot(latent.to(dot_ty), tl.trans(tl.load(wk_tile + c).to(dot_ty)), k, input_precision=precision)
    xe, xo = tl.split(tl.reshape(latent, [x.shape[0], CHUNK // 2, 2]))
    if ROTATE:
        xe, xo = _rope(xe, xo, start, freqs_ptr, c // 2 + pairs, HD // 2, ROPE_PAIRS, LIBDEVICE)
        xe = _act(xe, ACT_BF16)
        xo = _act(xo, ACT_BF16)
    packed, scale = _fp4(xe, xo, x.shape[0], CHUNK // 2, 8, True)
    tl.store(kv_row[:, None] + (c // 2 + pairs)[None, :], packed, mask=ok[:, None])
    tl.store(kv_row[:, None] + HD // 2 + c // 16 + tl.arange(0, CHUNK // 16)[None, :], scale, mask=ok[:, None])
    return k


@triton.jit
def _copy_rows(dst, src_v, src_g, dst_gate_offset, ok, HD: tl.constexpr, CHUNK_C: tl.constexpr):
    """fp32 (value, gate) rows [ROWS, HD] → partial rows: dst [ROWS] points at the value row."""
    cols = tl.arange(0, CHUNK_C)[None, :]
    for c in range(0, HD, CHUNK_C):
        v = tl.load(src_v[:, None] + c + cols, mask=ok[:, None])
        g = tl.load(src_g[:, None] + c + cols, mask=ok[:, None])
        tl.store(dst[:, None] + c + cols, v, mask=ok[:, None])
        tl.store(dst[:, None] + dst_gate_offset + c + cols, g, mask=ok[:, None])


@triton.jit(do_not_specialize=("num_entries", "num_rows", "num_row_programs"))
def _compress_kernel(
    proj_ptr,
    values_ptr,
    gates_ptr,
    partial_ptr,
    rows_ptr,
    slots_ptr,
    positions_ptr,
    row_requests_ptr,
    first_ptr,
    query_start_ptr,
    seqlens_ptr,
    state_slots_ptr,
    norm_w_ptr,
    wk_ptr,
    k_norm_w_ptr,
    freqs_ptr,
    kv_pool_ptr,
    key_pool_ptr,
    num_entries,
    num_rows,
    num_row_programs,
    proj_stride,
    values_stride,
    gates_stride,
    partial_stride_slot,
    partial_stride_row,
    partial_stride_kind,
    wk_stride,
    kv_stride_block,
    kv_stride_entry,
    key_stride_block,
    key_stride_entry,
    entries_per_block,
    partial_size,
    eps,
    RATIO: tl.constexpr,
    HD: tl.constexpr,
    DI: tl.constexpr,
    ROPE_PAIRS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    SUM_CHUNK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ACT_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    KH: tl.constexpr = DI // 2
    pid = tl.program_id(0)
    if pid < num_row_programs:
        # Ratio 2 only: the fp32 (value, gate) of each request's last ``partial_size`` positions.
        r = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = r < num_rows
        pos = tl.load(positions_ptr + r, mask=r_ok, other=0)
        req = tl.load(row_requests_ptr + r, mask=r_ok, other=0)
        first = tl.load(first_ptr + req, mask=r_ok, other=0)
        seqlen = tl.load(seqlens_ptr + req, mask=r_ok, other=0)
        slot = tl.load(state_slots_ptr + req, mask=r_ok, other=0)
        # The row on the straddling group's partial row is the entry program's to write (see the docstring).
        deferred = (first % 2 == 1) & ((pos - first + 1) % partial_size == 0)
        write = r_ok & (pos >= seqlen - partial_size) & ~deferred
        dst = partial_ptr + slot * partial_stride_slot + (pos % partial_size) * partial_stride_row
        _copy_rows(
            dst,
            values_ptr + r.to(tl.int64) * values_stride,
            gates_ptr + r.to(tl.int64) * gates_stride,
            partial_stride_kind,
            write,
            HD,
            CHUNK,
        )
    else:
        e = (pid - num_row_programs) * BLOCK_E + tl.arange(0, BLOCK_E)
        ok = e < num_entries
        row = tl.load(rows_ptr + e, mask=ok, other=0)
        slot = tl.load(slots_ptr + e, mask=ok, other=0)
        pos = tl.load(positions_ptr + row, mask=ok, other=0)
        start = pos - (RATIO - 1)  # the group's first position: its RoPE angle
        if RATIO == 2:
            req = tl.load(row_requests_ptr + row, mask=ok, other=0)
            first = tl.load(first_ptr + req, mask=ok, other=0)
            qs = tl.load(query_start_ptr + req, mask=ok, other=0)
            state = tl.load(state_slots_ptr + req, mask=ok, other=0)
            straddles = start < first  # member 0 is the cached position first − 1: read its partial row
            held = partial_ptr + state * partial_stride_slot + (start % partial_size) * partial_stride_row
            row0 = tl.where(straddles, 0, qs + start - first)
            v0 = tl.where(straddles, held, values_ptr + row0 * values_stride)
            g0 = tl.where(straddles, held + partial_stride_kind, gates_ptr + row0 * gates_stride)
            v1 = values_ptr + row * values_stride
            g1 = gates_ptr + row * gates_stride
        else:
            v0 = proj_ptr + e.to(tl.int64) * proj_stride
            g0 = v0
            v1 = v0
            g1 = v0

        sum_sq = tl.zeros([BLOCK_E], tl.float32)
        for c in range(0, HD, SUM_CHUNK):  # wider: more loads in flight (this loop is not pipelined)
            x = _chunk(c, v0, g0, v1, g1, ok, SUM_CHUNK, RATIO, ACT_BF16, LIBDEVICE)
            sum_sq += tl.sum(x * x, axis=1)
        inv_rms = tl.rsqrt(sum_sq / HD + eps)[:, None]

        k = tl.zeros([BLOCK_E, DI], tl.float32)  # wk · latent
        chans = tl.arange(0, CHUNK)
        kv_row = (
            kv_pool_ptr + (slot // entries_per_block) * kv_stride_block + (slot % entries_per_block) * kv_stride_entry
        )
        wk_tile = wk_ptr + tl.arange(0, DI)[:, None] * wk_stride + chans[None, :]  # [DI, CHUNK] tiles of wk [DI, HD]
        # Chunks without rotated pairs, then those with (HD − 2·ROPE_PAIRS is a multiple of CHUNK).
        for c in range(0, HD - 2 * ROPE_PAIRS, CHUNK):
            k = _entry_chunk(
                c,
                k,
                v0,
                g0,
                v1,
                g1,
                ok,
                inv_rms,
                start,
                kv_row,
                norm_w_ptr,
                wk_tile,
                freqs_ptr,
                False,
                HD,
                CHUNK,
                ROPE_PAIRS,
                RATIO,
                ACT_BF16,
                DOT_FP32,
                LIBDEVICE,
            )
        for c in range(HD - 2 * ROPE_PAIRS, HD, CHUNK):
            k = _entry_chunk(
                c,
                k,
                v0,
                g0,
                v1,
                g1,
                ok,
                inv_rms,
                start,
                kv_row,
                norm_w_ptr,
                wk_tile,
                freqs_ptr,
                True,
                HD,
                CHUNK,
                ROPE_PAIRS,
                RATIO,
                ACT_BF16,
                DOT_FP32,
                LIBDEVICE,
            )

        # Index key: the linear's output in the activation dtype, k_norm, RoPE, FP4 with e8m0 scales.
        k = _act(k, ACT_BF16)
        inv_k = tl.rsqrt(tl.sum(k * k, axis=1) / DI + eps)[:, None]
        k = _act(tl.load(k_norm_w_ptr + tl.arange(0, DI)).to(tl.float32)[None, :] * (k * inv_k), ACT_BF16)
        k_e, k_o = tl.split(tl.reshape(k, [BLOCK_E, KH, 2]))
        ku = tl.arange(0, KH)
        k_e, k_o = _rope(k_e, k_o, start, freqs_ptr, ku, KH, ROPE_PAIRS, LIBDEVICE)
        packed, scale = _fp4(_act(k_e, ACT_BF16), _act(k_o, ACT_BF16), BLOCK_E, KH, 16, False)
        key_row = (
            key_pool_ptr
            + (slot // entries_per_block) * key_stride_block
            + (slot % entries_per_block) * key_stride_entry
        )
        tl.store(key_row[:, None] + ku[None, :], packed, mask=ok[:, None])
        tl.store(key_row[:, None] + KH + tl.arange(0, KH // 16)[None, :], scale, mask=ok[:, None])

        if RATIO == 2:
            # The tail row q ≡ first − 1 (mod size) overwrites the partial row this program read.
            tl.debug_barrier()
            seqlen = tl.load(seqlens_ptr + req, mask=ok, other=0)
            lo_tail = tl.maximum(seqlen - partial_size, first)
            q = lo_tail + ((first - 1 - lo_tail) % partial_size + partial_size) % partial_size
            defer = ok & straddles & (q < seqlen)
            q_row = qs + tl.where(defer, q - first, 0)
            _copy_rows(
                held,
                values_ptr + q_row * values_stride,
                gates_ptr + q_row * gates_stride,
                partial_stride_kind,
                defer,
                HD,
                CHUNK,
            )


def compress(
    batch,
    rows: torch.Tensor,
    slots: torch.Tensor,
    kv_pool: torch.Tensor,
    key_pool: torch.Tensor,
    *,
    norm_weight: torch.Tensor,
    wk: torch.Tensor,
    k_norm_weight: torch.Tensor,
    freqs: torch.Tensor,
    eps: float,
    projected: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    gates: torch.Tensor | None = None,
    partial: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
    block_e: int = 16,
    chunk: int = 32,
    sum_chunk: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    dot_fp32: bool | None = None,
) -> None:
    """Write the entries and index keys of this step's complete groups (and, ratio 2, the partial rows).

    ``batch``: the StepBatch (positions, row_requests, first, query_start, seqlens_k, state_slots:
    int64 device tensors). rows, slots [E]: ``batch.entry_writes[ratio]``. kv_pool uint8 [blocks, epb,
    hd/2 + hd/16], key_pool uint8 [blocks, epb, di/2 + di/32]: ``CacheEngine.entries(layer)``.
    Ratio 1: ``projected`` [E, hd] = wkv · x[rows] in the model's dtype. Ratio 2: ``values``, ``gates``
    fp32 [R, hd] = ``Compressor.project(x)`` and ``partial`` fp32 [slots, size, 2, hd] =
    ``CacheEngine.partial(layer)``; ``dtype`` is the model's (x's) dtype, default fp32. Weights:
    compressor norm [hd], indexer ``wk`` [di, hd] (dtype bf16, or fp32 for fp32 models), ``k_norm`` [di],
    compress-RoPE ``freqs`` [rope/2]. ``dot_fp32`` (default: fp32 models) keeps the wk product in
    IEEE fp32. Tuning: ``chunk`` channels per step of the main pass (32; 64 spills at 8 warps),
    ``sum_chunk`` per step of the sum-of-squares pass (64), ``block_e`` entries per program (16, the
    smallest tensor-core M), ``num_warps`` 8 (4 spills).
    """
    ratio = 1 if projected is not None else 2
    hd, di = norm_weight.shape[0], k_norm_weight.shape[0]
    num_entries, num_rows = rows.shape[0], batch.positions.shape[0]
    dtype = (projected.dtype if projected is not None else dtype) or torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"activation dtype must be fp32 or bf16, got {dtype}")
    if ratio == 2 and (values is None or gates is None or partial is None):
        raise ValueError("ratio 2 needs values, gates and partial (ratio 1: projected)")
    if wk.shape != (di, hd) or wk.stride(-1) != 1:
        raise ValueError(f"wk must be [{di}, {hd}] with a contiguous last dim, got {tuple(wk.shape)}")
    if kv_pool.shape[-1] != hd // 2 + hd // 16 or key_pool.shape[-1] != di // 2 + di // 32:
        raise ValueError("pool entries do not fit head_dim / index_head_dim")
    rope = 2 * freqs.shape[0]
    while chunk > 16 and (hd - rope) % chunk:
        chunk //= 2  # the rotated channels start on a chunk boundary (tiny: 16)
    if hd % chunk or (hd - rope) % chunk or chunk % 16 or di % 32:
        raise ValueError(f"head_dim {hd} (rope {rope}) / index_head_dim {di} do not tile by {chunk} channels")
    dot_fp32 = dtype == torch.float32 if dot_fp32 is None else dot_fp32
    if ratio == 1:
        src = projected if projected.stride(-1) == 1 else projected.contiguous()
        values = gates = partial = src
        row_programs, size, p_strides = 0, 1, (0, 0, 0)
    else:
        if values.dtype != torch.float32 or gates.dtype != torch.float32 or partial.dtype != torch.float32:
            raise TypeError("values, gates and partial rows are fp32")
        src = values
        size = partial.shape[1]
        p_strides = partial.stride()[:3]
        block_r = 16
        row_programs = triton.cdiv(num_rows, block_r)
    grid = (row_programs + triton.cdiv(num_entries, block_e),)
    if grid[0] == 0:
        return
    _compress_kernel[grid](
        src,
        values,
        gates,
        partial,
        rows,
        slots,
        batch.positions,
        batch.row_requests,
        batch.first,
        batch.query_start,
        batch.seqlens_k,
        batch.state_slots,
        norm_weight,
        wk,
        k_norm_weight,
        freqs,
        kv_pool,
        key_pool,
        num_entries,
        num_rows,
        row_programs,
        src.stride(0),
        values.stride(0),
        gates.stride(0),
        *p_strides,
        wk.stride(0),
        kv_pool.stride(0),
        kv_pool.stride(1),
        key_pool.stride(0),
        key_pool.stride(1),
        kv_pool.shape[1],
        size,
        eps,
        RATIO=ratio,
        HD=hd,
        DI=di,
        ROPE_PAIRS=freqs.shape[0],
        BLOCK_E=block_e,
        CHUNK=chunk,
        SUM_CHUNK=min(hd, sum_chunk),
        BLOCK_R=16,
        ACT_BF16=dtype == torch.bfloat16,
        DOT_FP32=dot_fp32,
        LIBDEVICE=kv_pool.is_cuda,
        num_warps=num_warps,
        num_stages=num_stages,
        enable_fp_fusion=False,
    )


def compress_layer(cache, batch, attn, x: torch.Tensor, **kwargs) -> None:
    """Drop-in for ``TorchAttention.write_groups(attn, x)`` (without its ``rounding`` hook): the projections
    in torch (on fixed row tiles in the batch-invariant mode: ``invariance.by_rows``), the rest in the
    kernel. x [R, D] is the attention input (attn_norm output)."""
    import torch.nn.functional as F

    comp, idx, ratio = attn.compressor, attn.indexer, attn.ratio
    rows, slots = batch.entry_writes[ratio]
    kv_pool, key_pool = cache.entries(attn.layer)
    common = dict(
        norm_weight=comp.norm.weight,
        wk=idx.wk.weight,
        k_norm_weight=idx.k_norm.weight,
        freqs=attn.freqs,
        eps=comp.norm.eps,
        **kwargs,
    )
    if ratio == 1:
        projected = invariance.by_rows(
            lambda picked: F.linear(picked, comp.wkv.weight.to(x.dtype)), x[rows]
        )  # [E, hd], as the reference
        compress(batch, rows, slots, kv_pool, key_pool, projected=projected, **common)
    else:
        values, gates = invariance.by_rows(comp.project, x)  # [R, hd] fp32
        compress(
            batch,
            rows,
            slots,
            kv_pool,
            key_pool,
            values=values,
            gates=gates,
            partial=cache.partial(attn.layer),
            dtype=x.dtype,
            **common,
        )
