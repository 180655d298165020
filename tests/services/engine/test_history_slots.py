"""The penalties' token-count slots: each live request holds its own, and a slot given back is handed out again
before the table grows."""

from services.engine.history_slots import HistorySlots


def test_slots_are_distinct_while_held_and_reused_before_the_table_grows():
    slots = HistorySlots()
    held = [slots.take() for _ in range(3)]
    assert sorted(held) == [0, 1, 2]
    slots.give_back(held[1])
    assert slots.take() == held[1]  # reused, not a fourth slot
    assert slots.take() == 3  # none free: the table grows by one
