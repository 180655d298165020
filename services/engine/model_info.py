"""The served model as the APIs describe it (shinkai.v1 GetModelInfo, /v1/models, the OpenAPI limits)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelInfo:
    model: str  # the served name: the one /v1/models lists and requests must use
    vocab_size: int
    max_model_len: int  # prompt plus output tokens
    bos_token_id: int
    eos_token_id: int
    max_num_seqs: int  # requests running at once per engine
    # Tokens per KV block: the unit of the prefix cache's block hashes (services/engine/prefix/block_hash.py),
    # which a gateway computes to route by cached prefix; None: not said (a gateway then routes by load only).
    block_size: int | None = None
    image_placeholder_id: int | None = None  # the token a rendered chat puts per image; None: no images
