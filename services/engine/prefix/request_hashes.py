"""The engine's side of prefix caching: each live request's block hash chain (``block_hash.py``), handed to the
scheduler at admission (the prompt's full blocks) and as the request's output fills more blocks."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from scheduler_rs import Scheduler
from services.engine.prefix.block_hash import ImageSpan, block_hashes, root_hash


@dataclass
class _Chain:
    salt: str | None  # the request's cache_salt
    images: tuple[ImageSpan, ...]  # the prompt's image spans, with their content digests
    hashes: list[int] = field(default_factory=list)  # the hashes of the request's full blocks so far


def image_spans(prompt: Sequence[int], image_token_id: int, rows: torch.Tensor) -> tuple[ImageSpan, ...]:
    """Each run of image placeholders in ``prompt`` as one span, its digest the BLAKE2b of its embedding rows'
    bytes (``rows`` [P, D], one per placeholder in order): the same picture through the same tower gives the
    same rows, so the same digest."""
    spans = []
    k = 0
    i = 0
    while i < len(prompt):
        if prompt[i] != image_token_id:
            i += 1
            continue
        start = i
        while i < len(prompt) and prompt[i] == image_token_id:
            i += 1
        n = i - start
        data = rows[k : k + n].detach().to("cpu").contiguous()
        digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
        spans.append(ImageSpan(start, n, digest))
        k += n
    return tuple(spans)


class RequestHashes:
    """Block hash chains of the live requests of one engine (``model``: the served name, the chain's root)."""

    def __init__(self, scheduler: Scheduler, block_size: int, model: str) -> None:
        self.scheduler = scheduler
        self.block_size = block_size
        self.model = model
        self._chains: dict[str, _Chain] = {}

    def admit(
        self,
        request_id: str,
        prompt: Sequence[int],
        salt: str | None,
        images: tuple[ImageSpan, ...] = (),
        lookup: bool = True,
    ) -> None:
        """Hashes the prompt's full blocks for the scheduler, before the request's prefill starts. ``lookup``
        False: every position is computed (its blocks are still cached for others)."""
        chain = _Chain(salt, images)
        chain.hashes = block_hashes(prompt, self.block_size, model=self.model, salt=salt, images=images)
        self._chains[request_id] = chain
        spans = [(s.start, s.num_tokens) for s in images]
        self.scheduler.set_block_hashes(request_id, root_hash(self.model, salt), chain.hashes, spans, lookup)

    def grow(self, request_id: str, tokens: Sequence[int]) -> None:
        """``tokens``: the request's prompt and output so far; hashes the blocks they newly fill."""
        chain = self._chains.get(request_id)
        if chain is None or len(tokens) // self.block_size <= len(chain.hashes):
            return
        new = block_hashes(
            tokens,
            self.block_size,
            model=self.model,
            salt=chain.salt,
            images=chain.images,
            parent=chain.hashes[-1] if chain.hashes else None,
            first_block=len(chain.hashes),
        )
        chain.hashes.extend(new)
        self.scheduler.add_block_hashes(request_id, new)

    def fork(self, parent: str, child: str) -> None:
        """A forked child (an n > 1 choice) starts with its parent's chain; the scheduler copied the hashes with
        the request."""
        chain = self._chains.get(parent)
        if chain is not None:
            self._chains[child] = _Chain(chain.salt, chain.images, list(chain.hashes))

    def drop(self, request_id: str) -> None:
        self._chains.pop(request_id, None)

    def __len__(self) -> int:
        """The live requests holding a chain."""
        return len(self._chains)
