"""Per-request sampling parameters, validated before anything is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.engine.config import DEFAULT_MAX_TOKENS


@dataclass(frozen=True)
class SamplingParams:
    # Output tokens; None means the default (16).
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    # 0 is greedy argmax with ties to the lowest id.
    temperature: float = 1.0
    # In (0, 1]; 1 keeps everything.
    top_p: float = 1.0
    # -1 (or 0) keeps everything.
    top_k: int = -1
    # None gives the request its own random seed.
    seed: int | None = None
    # Completions per prompt; only 1 is served for now.
    n: int = 1
    # Any of these ends the request with finish reason "stop".
    stop_token_ids: tuple[int, ...] = ()
    # Keep generating through the end token.
    ignore_eos: bool = False
    # Top-n logprobs per output token; None returns only the chosen token's.
    logprobs: int | None = None
    # Never sampled.
    banned_token_ids: tuple[int, ...] = field(default=())
    # Output token i is forced_token_ids[i] instead of a draw (DeepInfer's golden tokens), for as many
    # tokens as the tuple holds; sampling resumes after it. Each forced token still reports its logprob
    # (and the top logprobs) under the processed distribution: -inf where the processing dropped it.
    forced_token_ids: tuple[int, ...] = field(default=())
    # (token id, bias) pairs added to the logits before every other step (OpenAI's logit_bias, -100 to 100);
    # a dict is accepted and kept as pairs sorted by id. A ban is exact only through banned_token_ids.
    logit_bias: tuple[tuple[int, float], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.max_tokens is not None and (isinstance(self.max_tokens, bool) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if (
            not isinstance(self.temperature, (int, float))
            or not math.isfinite(self.temperature)
            or self.temperature < 0
        ):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or a positive integer, got {self.top_k}")
        if self.n != 1:
            raise ValueError(f"n={self.n} is not supported yet: submit the prompt {self.n} times with different seeds")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in [0, 2**63), got {self.seed}")
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "banned_token_ids", tuple(self.banned_token_ids))
        object.__setattr__(self, "forced_token_ids", tuple(self.forced_token_ids))
        pairs = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        bias = tuple(sorted((int(t), float(v)) for t, v in pairs))
        for token_id, value in bias:
            if not (math.isfinite(value) and -100 <= value <= 100):
                raise ValueError(f"logit_bias[{token_id}] must be a number from -100 to 100, got {value}")
        if len({t for t, _ in bias}) != len(bias):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple((t, v) for t, v in bias if v != 0))

    @property
    def resolved_max_tokens(self) -> int:
        return DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
