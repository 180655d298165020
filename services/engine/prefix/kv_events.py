"""The prefix cache's block events: what entered and left one engine's cache, for the gateway's router."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KvEvents:
    """The blocks that entered or left the engine's prefix cache since the previous ``Engine.take_kv_events()``.

    Hashes are ``block_hash.block_hashes`` values (unsigned 64-bit). A hash can appear in both lists when a
    block was stored and evicted (or evicted and stored again) between two calls; apply ``cleared`` first,
    then ``removed``, then ``stored`` only if the caller wants the net state of a short window, or replay them
    in that order: the engine reports a block stored at most once while it stays cached.
    """

    stored: list[int] = field(default_factory=list)  # hashes of blocks that entered the cache, oldest first
    removed: list[int] = field(default_factory=list)  # hashes of blocks evicted from the cache, oldest first
    cleared: bool = False  # the whole cache was dropped (every earlier stored hash is gone) before these events
