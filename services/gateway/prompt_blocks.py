"""A prompt's full-block hashes as an engine's prefix cache names them, computed by the gateway to route.

The engine expands each image's one placeholder token into its span only after routing, from the image's
header and the model's vision config, which the gateway does not know; so the gateway hashes the blocks that
end before the first image placeholder (their tokens and positions are the same after expansion), and none
after it. The root is the served model name and the request's cache salt (services/engine/prefix/block_hash.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from services.engine.prefix.block_hash import block_hashes


@dataclass(frozen=True)
class PromptBlocks:
    model: str  # the served model name: the engines' chains are rooted at it
    block_size: int  # tokens per block of the engines' caches (ModelInfo.block_size)
    image_placeholder_id: int | None  # the token a rendered chat puts per image; None: the model takes none

    def hashes(self, prompt_token_ids: Sequence[int], salt: str | None = None) -> list[int]:
        """The chain of the prompt's full blocks before its first image placeholder."""
        ids = prompt_token_ids
        if self.image_placeholder_id is not None and self.image_placeholder_id in ids:
            ids = ids[: list(ids).index(self.image_placeholder_id)]
        return block_hashes(ids, self.block_size, model=self.model, salt=salt)

    def num_blocks(self, num_prompt_tokens: int) -> int:
        """Blocks a prompt of ``num_prompt_tokens`` fills, its partial last one included."""
        return -(-num_prompt_tokens // self.block_size)
