"""Ticket counters: how a split kernel's last program to finish knows it is last.

A kernel whose grid splits one output tile's work over several programs (partial sums to a buffer) can
finish the tile in the same launch: each program stores its partials, then takes a ticket with an integer
atomic (acquire-release, GPU scope); the program that draws ticket ``splits − 1`` sees every partial and
sums them in a fixed order, so only *who* sums depends on timing, never the order of the sum. That program
puts the counter back to 0, so counters are 0 between launches and graph replays. Launches on a device
are assumed to run one at a time (one compute stream), as the worker's do. ``kernels/fp8_splitk.py`` is the
first user (its own counters); ``kernels/moe_router.py`` and ``kernels/mhc.py`` take theirs here.
"""

from __future__ import annotations

import torch

_TICKETS: dict[tuple[str, torch.device, int], torch.Tensor] = {}
"""Per (user, device, tiles): int32 zeros. Never freed: a captured graph reads them by address."""


def tickets(user: str, device: torch.device, num_tiles: int) -> torch.Tensor:
    """int32 [num_tiles] counters, 0 between launches, for the kernel named ``user``."""
    key = (user, torch.device(device), num_tiles)
    if key not in _TICKETS:
        _TICKETS[key] = torch.zeros(num_tiles, dtype=torch.int32, device=device)
    return _TICKETS[key]


def all_zero() -> bool:
    """Every counter back at 0 (for tests: no launch left a ticket behind)."""
    return all(int(t.abs().sum()) == 0 for t in _TICKETS.values())
