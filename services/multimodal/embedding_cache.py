"""Encoded spans by the image's content hash (sha256 of its bytes), least recently used first out.

The cache holds at most ``max_bytes`` of embeddings; an entry larger than that is never kept. Keys are
content hashes, so two requests with the same image bytes share one entry whatever their URLs.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

import torch

from model.deepseek_v41.image_grid import ImageGrid


@dataclass(frozen=True)
class EncodedImage:
    grid: ImageGrid  # the resize and grids the span was computed for
    span: torch.Tensor  # fp32 [grid.num_tokens, D] on the CPU


def content_hash(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class EmbeddingCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0  # Σ span bytes held
        self._entries: OrderedDict[str, EncodedImage] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> EncodedImage | None:
        entry = self._entries.get(key)
        if entry is not None:
            self._entries.move_to_end(key)
        return entry

    def put(self, key: str, entry: EncodedImage) -> None:
        size = entry.span.numel() * entry.span.element_size()
        if size > self.max_bytes or key in self._entries:
            return
        self._entries[key] = entry
        self.num_bytes += size
        while self.num_bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.num_bytes -= old.span.numel() * old.span.element_size()
