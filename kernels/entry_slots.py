"""Selected entry ids → pool slots in one launch (``kernels.reference.entry_slots``, about 12 torch launches).

Row r's entry e (−1 = none) of its request's block table lives at pool slot
``block_tables[r, e // epb] · epb + e mod epb`` (the cache engine's ``entry_writes`` slots); −1 stays −1.
Integer maths throughout (int64, then int32 as the reference casts), so the slots are ``==`` the
reference's (tests/kernels/test_entry_slots.py). Graph-safe: device tensors in, one output allocation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=("num_entries", "entries_stride", "tables_stride", "out_stride"))
def _entry_slots_kernel(
    entries_ptr,
    tables_ptr,
    out_ptr,
    num_entries,
    entries_stride,
    tables_stride,
    out_stride,
    entries_per_block,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK_K)
    in_row = j < num_entries
    e = tl.load(entries_ptr + row * entries_stride + j, mask=in_row, other=-1).to(tl.int64)
    live = e >= 0
    block = tl.load(tables_ptr + row * tables_stride + e // entries_per_block, mask=live, other=0).to(tl.int64)
    slots = tl.where(live, block * entries_per_block + e % entries_per_block, -1)
    tl.store(out_ptr + row * out_stride + j, slots.to(tl.int32), mask=in_row)


def entry_slots(entries: torch.Tensor, block_tables: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """Entry ids int [R, k] (−1 = none, else < width · epb), block tables int [R, width] → int32 [R, k]."""
    if entries.ndim != 2 or block_tables.ndim != 2 or entries.shape[0] != block_tables.shape[0]:
        raise ValueError(
            f"entries [R, k] and block_tables [R, width] needed, got {tuple(entries.shape)} "
            f"and {tuple(block_tables.shape)}"
        )
    num_rows, k = entries.shape
    out = torch.empty(num_rows, k, dtype=torch.int32, device=entries.device)
    if num_rows == 0 or k == 0:
        return out
    if entries.stride(1) != 1:
        entries = entries.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    _entry_slots_kernel[(num_rows,)](
        entries,
        block_tables,
        out,
        k,
        entries.stride(0),
        block_tables.stride(0),
        out.stride(0),
        entries_per_block,
        BLOCK_K=triton.next_power_of_2(k),
    )
    return out
