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
