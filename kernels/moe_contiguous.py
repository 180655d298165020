"""DeepGEMM's contiguous layout and its gathered activations in one launch (two where x is quantised first).

From ``KernelMoE``'s masked-layout meta (device ``counts`` [G], ``row_ids`` / ``route_w`` [G, cap], ``slot_of``
[T, k]) and the activations x [T, D'], ``contiguous_layout`` writes what ``deepgemm_moe.experts`` feeds DeepGEMM's
contiguous grouped GEMMs and the combine, as ``deepgemm_moe.contiguous_layout`` (the torch reference: about 30
launches of ``contiguous_rows``, the gathers and the slot map) does, byte for byte:

- per contiguous row r of the fixed M (``deepgemm_moe.contiguous_size``): its expert (``m_indices``, −1 on pad
  rows), its token (0 on pad rows), its route weight (0 on pad rows) and its token's quantised row a_q[r], a_s[r];
- per pick, the contiguous row of its slot (``rows_of``, the combine's map).

Each program recomputes the spans' prefix sum from the ≤ G device counts (``tl.cumsum`` over a power-of-two
vector): no cumsum launch, no host read, shapes fixed by T, k and G alone. Row programs come first in the grid,
then the slot-map programs. Rows past the last span get their metadata but no activations: every block there
starts with ``m_indices`` −1, which DeepGEMM skips, so it never reads them (the reference gathers token 0 there).

Two ways to the rows (``per_row``): quantise each row from x inside this launch (``quant_fp8._quantize_rows``,
``quantize_act``'s rounding, so the same bytes), which reads x's row once per pick (R = picks/T times); or
``quant_fp8.quantize_act`` first and a byte gather of its rows, which reads x once and the e4m3 rows R times.
``per_row`` None takes whichever moves fewer bytes (``quantizes_per_row``): the gather from R ≥ 4 in bf16 (v41,
top-6 + shared, R = 7: about 3.8·T·D' bytes fewer, for one launch more).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.deepgemm_moe import ContiguousRows, contiguous_size
from kernels.quant_fp8 import _quantize_rows, quantize_act
from kernels.reference import GROUP

ROWS = 16
"""Contiguous rows per row program."""
BLOCK_WORDS = 256
"""4-byte words (1 KB) of a row per step of the byte gather."""
BLOCK_PICKS = 256
"""Picks per slot-map program."""
SCALE_BYTES = 1 + 4 / GROUP
"""Bytes per channel of a quantised row: the e4m3 value and its share of the fp32 scale."""


@triton.jit(do_not_specialize=("num_rows", "num_picks", "capacity"))
def _contiguous_kernel(
    src_ptr,
    src_scale_ptr,
    counts_ptr,
    row_ids_ptr,
    route_w_ptr,
    slot_of_ptr,
    a_q_ptr,
    a_s_ptr,
    m_ptr,
    token_ptr,
    w_ptr,
    rows_of_ptr,
    num_rows,
    num_picks,
    capacity,
    src_row_stride,
    NUM_GROUPS: tl.constexpr,
    G_PAD: tl.constexpr,
    ALIGN: tl.constexpr,
    ROW_SIZE: tl.constexpr,
    SCALES: tl.constexpr,
    SCALES_PAD: tl.constexpr,
    PER_ROW: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_WORDS: tl.constexpr,
    BLOCK_PICKS: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    g = tl.arange(0, G_PAD)
    counts = tl.load(counts_ptr + g, mask=g < NUM_GROUPS, other=0)
    spans = (counts + ALIGN - 1) // ALIGN * ALIGN  # 0 past the G experts
    ends = tl.cumsum(spans, 0)
    starts = ends - spans  # expert g's first contiguous row
    num_row_programs = tl.cdiv(num_rows, ROWS)
    if pid < num_row_programs:
        r = pid * ROWS + tl.arange(0, ROWS)
        in_rows = r < num_rows
        # r's expert: the number of spans ending at or before r (≥ G on the rows past the last span, where the
        # padding's empty spans end too).
        e = tl.sum((ends[None, :] <= r[:, None]).to(tl.int32), axis=1)
        pick = g[None, :] == e[:, None]
        j = r - tl.sum(tl.where(pick, starts[None, :], 0), axis=1)  # the slot within e's span
        real = in_rows & (j < tl.sum(tl.where(pick, counts[None, :], 0), axis=1))  # false where e ≥ G
        slot = e.to(tl.int64) * capacity + j
        # Slots past the counts hold any bytes (even bad token ids): only real rows read them.
        token = tl.load(row_ids_ptr + slot, mask=real, other=0).to(tl.int32)
        tl.store(m_ptr + r, tl.where(real, e, -1), mask=in_rows)
        tl.store(token_ptr + r, token, mask=in_rows)
        tl.store(w_ptr + r, tl.load(route_w_ptr + slot, mask=real, other=0.0), mask=in_rows)
        live = r < tl.sum(spans, 0)  # rows of the spans (pad rows there gather token 0): what DeepGEMM reads
        src_row = token.to(tl.int64) * src_row_stride
        dst_row = r.to(tl.int64)
        if PER_ROW:  # src: x [T, ROW_SIZE] channels
            for group in range(SCALES):
                cols = group * GROUP + tl.arange(0, GROUP)
                x = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=live[:, None], other=0.0)
                q, scale = _quantize_rows(x.to(tl.float32))
                tl.store(a_q_ptr + dst_row[:, None] * ROW_SIZE + cols[None, :], q, mask=live[:, None])
                tl.store(a_s_ptr + dst_row * SCALES + group, scale, mask=live)
        else:  # src: the e4m3 rows as int32 words [T, ROW_SIZE], 4 codes each
            for start in tl.static_range(0, ROW_SIZE, BLOCK_WORDS):
                cols = start + tl.arange(0, BLOCK_WORDS)
                ok = live[:, None] & (cols < ROW_SIZE)[None, :]
                v = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=ok)
                tl.store(a_q_ptr + dst_row[:, None] * ROW_SIZE + cols[None, :], v, mask=ok)
            s = tl.arange(0, SCALES_PAD)
            ok = live[:, None] & (s < SCALES)[None, :]
            scale = tl.load(src_scale_ptr + token.to(tl.int64)[:, None] * SCALES + s[None, :], mask=ok)
            tl.store(a_s_ptr + dst_row[:, None] * SCALES + s[None, :], scale, mask=ok)
    else:  # names of their own: a name bound in both branches must have one type in both (compiled Triton)
        i = (pid - num_row_programs) * BLOCK_PICKS + tl.arange(0, BLOCK_PICKS)
        pick_ok = i < num_picks
        pick_slot = tl.load(slot_of_ptr + i, mask=pick_ok, other=0)
        pick_expert = pick_slot // capacity
        pick_start = tl.sum(tl.where(g[None, :] == pick_expert[:, None], starts[None, :], 0), axis=1)
        tl.store(rows_of_ptr + i, pick_start.to(tl.int64) + pick_slot - pick_expert * capacity, mask=pick_ok)


def quantizes_per_row(x: torch.Tensor, num_picks: int) -> bool:
    """Whether quantising each contiguous row from x [T, D'] reads fewer bytes than ``quantize_act`` then the byte
    gather, with R = num_picks / T rows per token: R·s against s + (R + 1)·SCALE_BYTES per channel (s: x's
    element size; x once plus the e4m3 rows' write and R reads). The rows' own write is the same both ways."""
    rows_per_token = num_picks / max(1, x.shape[0])
    size = x.element_size()
    return (rows_per_token - 1) * size < (rows_per_token + 1) * SCALE_BYTES


def contiguous_layout(
    x: torch.Tensor, meta: dict[str, torch.Tensor], align: int, *, per_row: bool | None = None
) -> ContiguousRows:
    """x [T, D'] (bf16/fp32, D' % 128 == 0) and ``KernelMoE``'s meta → ``deepgemm_moe.ContiguousRows``, the
    bytes of ``deepgemm_moe.contiguous_layout`` (with ``quant_fp8.quantize_act``) on every row of the spans, with
    device ops only. ``per_row``: quantise per row in this launch (True), or ``quantize_act`` first (False);
    None: whichever reads fewer bytes (``quantizes_per_row``)."""
    num_tokens, channels = x.shape
    if channels % GROUP:
        raise ValueError(f"channels must be a multiple of {GROUP}, got {channels}")
    row_ids, route_w, slot_of = (meta[k].contiguous() for k in ("row_ids", "route_w", "slot_of"))
    num_groups, capacity = row_ids.shape
    num_picks = slot_of.numel()
    num_rows = contiguous_size(num_picks, num_groups, align)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if per_row is None:
        per_row = quantizes_per_row(x, num_picks)
    device = x.device
    a_q = torch.empty(num_rows, channels, dtype=torch.float8_e4m3fn, device=device)
    a_s = torch.empty(num_rows, channels // GROUP, dtype=torch.float32, device=device)
    m_indices = torch.empty(num_rows, dtype=torch.int32, device=device)
    tokens = torch.empty(num_rows, dtype=torch.int32, device=device)
    weights = torch.empty(num_rows, dtype=torch.float32, device=device)
    rows_of = torch.empty(slot_of.shape, dtype=torch.int64, device=device)
    if per_row:
        src, src_scale, dst = x, a_s, a_q  # src_scale unread
    else:
        x_q, src_scale = quantize_act(x)
        src, dst = x_q.view(torch.int32), a_q.view(torch.int32)  # D' % 4 == 0: whole words
    grid = (triton.cdiv(num_rows, ROWS) + triton.cdiv(num_picks, BLOCK_PICKS),)
    _contiguous_kernel[grid](
        src,
        src_scale,
        meta["counts"].to(torch.int32).contiguous(),
        row_ids,
        route_w,
        slot_of,
        dst,
        a_s,
        m_indices,
        tokens,
        weights,
        rows_of,
        num_rows,
        num_picks,
        capacity,
        src.stride(0),
        NUM_GROUPS=num_groups,
        G_PAD=triton.next_power_of_2(num_groups),
        ALIGN=align,
        ROW_SIZE=src.shape[1],
        SCALES=channels // GROUP,
        SCALES_PAD=triton.next_power_of_2(channels // GROUP),
        PER_ROW=per_row,
        ROWS=ROWS,
        BLOCK_WORDS=BLOCK_WORDS,
        BLOCK_PICKS=BLOCK_PICKS,
        GROUP=GROUP,
    )
    return ContiguousRows((a_q, a_s), m_indices, tokens, weights, rows_of)
