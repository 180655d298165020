"""Slots of the worker's per-request token counts, which the presence, frequency and repetition penalties read: a
live request with penalties holds one (``LiveRequest.history``), and a slot given back is handed out again first."""

from __future__ import annotations


class HistorySlots:
    def __init__(self) -> None:
        self._free: list[int] = []  # slots given back, reused first
        self._num_slots = 0  # slots handed out so far (the worker's table grows to this many)

    def take(self) -> int:
        slot = self._free.pop() if self._free else self._num_slots
        self._num_slots = max(self._num_slots, slot + 1)
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def num_held(self) -> int:
        """Slots handed out and not given back."""
        return self._num_slots - len(self._free)
