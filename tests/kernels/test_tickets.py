"""kernels/tickets.py: one zeroed counter tensor per (user, device, tiles), kept (graphs read it by address).
The counters' use (the last program sums, then resets) is tested with its users: test_moe_router.py and
test_mhc.py (interpreted and on the GPU)."""

from __future__ import annotations

import torch

from kernels import tickets


def test_counters_are_zero_kept_and_per_user():
    a = tickets.tickets("test_a", torch.device("cpu"), 3)
    assert a.dtype == torch.int32 and a.tolist() == [0, 0, 0]
    assert tickets.tickets("test_a", torch.device("cpu"), 3) is a
    b = tickets.tickets("test_b", torch.device("cpu"), 3)
    assert b is not a and tickets.tickets("test_a", torch.device("cpu"), 4) is not a
    a[1] = 1
    assert not tickets.all_zero()
    a.zero_()
    assert tickets.all_zero()
