from services.engine.prefix.kv_events import KvEvents


def applied(held: set[int], events: KvEvents) -> set[int]:
    """What a subscriber holds after applying ``events`` in their order: cleared, removed, stored."""
    held = set() if events.cleared else set(held)
    return (held - set(events.removed)) | set(events.stored)


def test_two_takes_joined_give_what_applying_both_gives():
    held = {1, 2, 3}
    cases = [
        (KvEvents([4], [1]), KvEvents([5], [4, 2])),  # stored then evicted in the next window: in neither list
        (KvEvents([], [3]), KvEvents([3], [])),  # evicted, then stored again: held
        (KvEvents([4], []), KvEvents([6], [], cleared=True)),  # a later clear wins
        (KvEvents([7], [], cleared=True), KvEvents([8], [7])),  # an earlier clear stays
    ]
    for first, later in cases:
        joined = first.then(later)
        assert applied(held, joined) == applied(applied(held, first), later), (first, later, joined)
    assert KvEvents([4], [1]).then(KvEvents([5], [4, 2])) == KvEvents([5], [1, 2])
