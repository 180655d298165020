"""The one hash of a full block's content, shared by the engine's prefix cache and the gateway's router.

Block i of a prompt (token positions ``i·block_size … (i+1)·block_size − 1``) is named by a chain:

    h_0 = H(root ‖ tokens_0 ‖ images_0)          root = H("shinkai-prefix-v1" ‖ model ‖ salt)
    h_i = H(h_{i−1} ‖ tokens_i ‖ images_i)

- ``tokens_i``: the block's token ids, little-endian uint32 each;
- ``images_i``: the content digests of the images whose expanded spans overlap the block, each with the
  span's start position (two prompts with the same placeholder ids but different pictures differ);
- ``model`` and the request's ``salt`` (``cache_salt`` in the API, as vLLM) enter only the root, so a
  block is shared only within one model and one salt.

H is BLAKE2b with an 8-byte digest, read as an unsigned 64-bit little-endian integer: a block hash fits the
scheduler's ``u64`` and a NATS event's JSON number. A collision needs 2^32 distinct blocks for even odds;
the cache keys on the whole chain, so two requests share block i only if every earlier block matched too.

Only full blocks are hashed: a partial last block is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

DIGEST_BYTES = 8
VERSION = b"shinkai-prefix-v1"


@dataclass(frozen=True)
class ImageSpan:
    """One image's expanded span in a prompt."""

    start: int  # first token position of the span
    num_tokens: int  # positions the span covers
    digest: bytes  # content hash of the image's bytes (any length; e.g. sha256 of the fetched bytes)


def _h(*parts: bytes) -> int:
    b = hashlib.blake2b(digest_size=DIGEST_BYTES)
    for part in parts:
        b.update(part)
    return int.from_bytes(b.digest(), "little")


def root_hash(model: str, salt: str | None = None) -> int:
    """The chain's root for one model and salt."""
    salt_bytes = b"" if salt is None else salt.encode()
    return _h(VERSION, struct.pack("<I", len(model.encode())), model.encode(), salt_bytes)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    model: str,
    salt: str | None = None,
    images: Sequence[ImageSpan] = (),
    parent: int | None = None,
    first_block: int = 0,
) -> list[int]:
    """The hashes of the full blocks of ``token_ids``, block ``first_block`` on.

    ``parent`` is block ``first_block − 1``'s hash (None: start from the root, ``first_block`` must be 0), so
    a growing request hashes each newly filled block once: ``block_hashes(ids, bs, model=m, parent=h[-1],
    first_block=len(h))`` with the same ``ids`` from position 0.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if (parent is None) != (first_block == 0):
        raise ValueError("parent is the hash of block first_block - 1: give both, or neither for block 0")
    prev = root_hash(model, salt) if parent is None else parent
    out: list[int] = []
    for i in range(first_block, len(token_ids) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        tokens = struct.pack(f"<{block_size}I", *token_ids[lo:hi])
        overlapping = b"".join(
            struct.pack("<Q", s.start) + s.digest for s in images if s.start < hi and s.start + s.num_tokens > lo
        )
        prev = _h(struct.pack("<Q", prev), tokens, overlapping)
        out.append(prev)
    return out
