"""The prefix cache's block events: what entered and left one engine's cache, for the gateway's router."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KvEvents:
    """The blocks that entered or left the engine's prefix cache since the previous ``Engine.take_kv_events()``.

    Hashes are ``block_hash.block_hashes`` values (unsigned 64-bit). The lists are net of the window: a block
    stored and evicted again between two calls appears in neither; one evicted and stored again appears in
    both. Apply ``cleared`` first, then ``removed``, then ``stored``, and the receiver's view equals the cache.
    """

    stored: list[int] = field(default_factory=list)  # hashes of blocks that entered the cache, oldest first
    removed: list[int] = field(default_factory=list)  # hashes of blocks evicted from the cache, oldest first
    cleared: bool = False  # the whole cache was dropped (every earlier stored hash is gone) before these events

    def then(self, later: KvEvents) -> KvEvents:
        """These events followed by ``later``'s, as one net change (what a subscriber applying both would hold)."""
        if later.cleared:
            return KvEvents(list(later.stored), list(later.removed), True)
        gone = set(later.removed)
        came = set(self.stored)
        return KvEvents(
            [h for h in self.stored if h not in gone] + later.stored,
            self.removed + [h for h in later.removed if h not in came],
            self.cleared,
        )
