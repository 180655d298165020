"""Entry → pool slot kernel vs ``kernels.reference.entry_slots``: ``==``, interpreted on CPU and compiled on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.interpret import interpreter, load_interpreted


def _case(num_rows: int, k: int, width: int, epb: int, entry_dtype: torch.dtype, gen: torch.Generator):
    """Entries over every block of the tables (first and last entry included) with −1 holes, and tables of
    distinct block ids (so a wrong block or offset gives a wrong slot)."""
    entries = torch.randint(0, width * epb, (num_rows, k), generator=gen)
    entries[0, 0], entries[-1, -1] = 0, width * epb - 1
    entries[torch.rand(num_rows, k, generator=gen) < 0.3] = -1
    tables = torch.randperm(num_rows * width * 3, generator=gen)[: num_rows * width].view(num_rows, width) + 1
    return entries.to(entry_dtype), tables.to(torch.int32)


@pytest.mark.parametrize(
    ("num_rows", "k", "width", "epb", "entry_dtype"),
    [(8, 4, 6, 16, torch.int32), (5, 7, 3, 64, torch.int64), (3, 1, 1, 8, torch.int32)],
)
def test_entry_slots_interpreted_equals_reference(num_rows, k, width, epb, entry_dtype):
    entries, tables = _case(num_rows, k, width, epb, entry_dtype, torch.Generator().manual_seed(num_rows * k))
    with interpreter():
        got = load_interpreted("entry_slots").entry_slots(entries, tables, epb)
    want = reference.entry_slots(entries, tables, epb)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    assert (want == -1).any() and (want > 0).any()


def test_entry_slots_strided_tables_and_empty():
    entries, tables = _case(4, 5, 4, 8, torch.int32, torch.Generator().manual_seed(2))
    wide = torch.zeros(4, 9, dtype=torch.int32)
    wide[:, 2:6] = tables
    module = load_interpreted("entry_slots")
    with interpreter():
        got = module.entry_slots(entries, wide[:, 2:6], 8)
        empty = module.entry_slots(entries[:, :0], tables, 8)
    assert torch.equal(got, reference.entry_slots(entries, tables, 8))
    assert empty.shape == (4, 0)
    with pytest.raises(ValueError, match="entries"):
        module.entry_slots(entries[0], tables, 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_entry_slots_gpu_equals_reference():
    from kernels.entry_slots import entry_slots

    entries, tables = _case(64, 512, 32, 64, torch.int32, torch.Generator().manual_seed(5))
    got = entry_slots(entries.cuda(), tables.cuda(), 64)
    assert torch.equal(got.cpu(), reference.entry_slots(entries, tables, 64))
