"""Per-request sampling parameters, validated before anything is queued."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from services.engine.structured.constraint import Constraint

N_SEED_STEP = 0x9E3779B97F4A7C15
"""Choice i of a request with ``n`` > 1 draws with seed (seed + i · N_SEED_STEP) mod 2⁶³ (SplitMix64's golden-ratio
increment): choice 0 keeps the request's seed, so n = 1 draws as before; the choices' Philox keys are far apart for
neighbouring seeds; and a request of n = 1 with choice i's seed gives choice i's tokens."""

PENALTY_LIMIT = 2.0
"""presence_penalty and frequency_penalty lie in [-PENALTY_LIMIT, PENALTY_LIMIT] (OpenAI's range)."""


@dataclass(frozen=True)
class SamplingParams:
    # Output tokens; None means the rest of the context (max_model_len minus the prompt).
    max_tokens: int | None = None
    # 0 is greedy argmax with ties to the lowest id.
    temperature: float = 1.0
    # In (0, 1]; 1 keeps everything.
    top_p: float = 1.0
    # -1 (or 0) keeps everything.
    top_k: int = -1
    # None gives the request its own random seed.
    seed: int | None = None
    # Completions per prompt (choices), >= 1: the prompt is prefilled once and its blocks shared through the
    # scheduler's fork; choice i draws with its own seed stream (N_SEED_STEP).
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
    # OpenAI's: subtracted once from the logit of every token that occurs in the output so far; in [-2, 2].
    presence_penalty: float = 0.0
    # OpenAI's: subtracted from each token's logit once per occurrence in the output so far; in [-2, 2].
    frequency_penalty: float = 0.0
    # vLLM's: the logit of every token in the prompt or the output so far is divided by it when positive and
    # multiplied by it otherwise; > 0, 1 is off.
    repetition_penalty: float = 1.0
    # The end token and stop_token_ids are banned until this many output tokens exist (vLLM's).
    min_tokens: int = 0
    # vLLM's: drop tokens whose probability (at the sampling temperature) is below min_p times the most likely
    # token's; in [0, 1], 0 is off.
    min_p: float = 0.0
    # vLLM's: the logprob of every prompt token after the first under the model's raw distribution, plus the
    # top this-many (0 to 20) per position; None is off.
    prompt_logprobs: int | None = None
    # Structured output: what the text must match (a JSON schema, a regex, an EBNF grammar, ...), enforced by a
    # token mask in the sampler (services/engine/structured/); None is unconstrained.
    constraint: Constraint | None = None
    # Prefix caching's salt (vLLM's cache_salt): a request shares cached blocks only with requests of the same
    # salt (block_hash.py's root), so tenants that must not observe each other's prompts by timing use their own;
    # None shares with every unsalted request.
    cache_salt: str | None = None

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
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and -PENALTY_LIMIT <= value <= PENALTY_LIMIT):
                raise ValueError(f"{name} must be a number from -2 to 2, got {value}")
        if not (_is_number(self.repetition_penalty) and 0 < self.repetition_penalty):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p}")
        if self.prompt_logprobs is not None and (
            isinstance(self.prompt_logprobs, bool) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise ValueError(f"prompt_logprobs must be between 0 and 20, got {self.prompt_logprobs}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError("cache_salt must be a non-empty string when given")
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

    def resolved_max_tokens(self, num_prompt_tokens: int, max_model_len: int) -> int:
        """The output tokens the request may produce: max_tokens, or (None) the rest of the context."""
        return max_model_len - num_prompt_tokens if self.max_tokens is None else self.max_tokens

    @property
    def has_penalties(self) -> bool:
        """Some penalty reads the request's token counts."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    def choice_seed(self, seed: int, index: int) -> int:
        """Choice ``index``'s seed stream of a request drawing with ``seed`` (N_SEED_STEP)."""
        return (seed + index * N_SEED_STEP) % (1 << 63)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
