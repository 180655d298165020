"""Which full blocks each engine replica holds in its prefix cache, from its KV events (`subjects.KV_EVENTS`).

Per replica, an insertion-ordered set of block hashes (services/engine/prefix/block_hash.py): a message
applies ``cleared`` (forget the replica's blocks), then ``removed``, then ``stored``; a hash stored again
moves to the newest end. Memory is bounded: past ``max_blocks_per_replica`` hashes the oldest are dropped,
which under-counts that replica's cache (fewer routed hits, never a wrong answer: the engine looks its cache
up itself). The router forgets a replica at each of its lifecycle events (services/gateway/router.py).

A request's overlap with a replica is the number of its leading block hashes, in order, that the replica holds:
the chain makes block i's hash depend on every earlier block, so that run is exactly the prefix the replica's
cache can serve.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

DEFAULT_MAX_BLOCKS_PER_REPLICA = 1 << 18  # hashes kept per replica (~100 bytes each in a Python dict)


class PrefixIndex:
    def __init__(self, max_blocks_per_replica: int = DEFAULT_MAX_BLOCKS_PER_REPLICA) -> None:
        self.max_blocks_per_replica = max_blocks_per_replica
        self._held: dict[str, dict[int, None]] = {}  # replica → its block hashes, oldest first
        self.num_dropped = 0  # hashes dropped for the bound

    def apply(self, replica: str, stored: Iterable[int], removed: Iterable[int], cleared: bool) -> None:
        """One KV-event message of ``replica``."""
        held = self._held.setdefault(replica, {})
        if cleared:
            held.clear()
        for h in removed:
            held.pop(h, None)
        for h in stored:
            held.pop(h, None)
            held[h] = None
        excess = len(held) - self.max_blocks_per_replica
        if excess > 0:
            for h in list(_first(held, excess)):
                del held[h]
            self.num_dropped += excess

    def forget(self, replica: str) -> None:
        """Drops what ``replica`` held: it stopped serving, or started afresh."""
        self._held.pop(replica, None)

    def heard(self, replica: str) -> bool:
        """True once ``replica`` published a KV event (since it was last forgotten)."""
        return replica in self._held

    def num_blocks(self, replica: str) -> int:
        return len(self._held.get(replica, ()))

    def holders(self, block_hash: int) -> set[str]:
        """The replicas holding the block ``block_hash``."""
        return {replica for replica, held in self._held.items() if block_hash in held}

    def overlap(self, replica: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes`` (a prompt's block chain), from the first on, ``replica`` holds."""
        held = self._held.get(replica)
        if not held:
            return 0
        n = 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n


def _first(held: dict[int, None], n: int) -> Iterable[int]:
    for i, h in enumerate(held):
        if i >= n:
            return
        yield h
