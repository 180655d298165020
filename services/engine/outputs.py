"""What `LLM.generate` returns per prompt."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.engine.finish_reason import FinishReason


@dataclass
class RequestOutput:
    # The request's unique id (`LLM.generate` numbers its prompts; a server gets the gateway's id).
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    # Logprob of each output token under the processed distribution.
    logprobs: list[float] = field(default_factory=list)
    # Per output token, the top-n (token id, logprob) pairs, when requested.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # Why the request ended; None while running.
    finish_reason: FinishReason | None = None
    # The end or stop token that ended the request, if one did.
    stop_token_id: int | None = None
    # prompt_logprobs: per prompt token after the first, its logprob under the raw model (the log-softmax of
    # the logits at the position before it); None when not asked for.
    prompt_logprobs: list[float] | None = None
    # prompt_logprobs: per such token, the top-n (token id, logprob) pairs at its position.
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # prompt_logprobs: per such token, its rank at its position (vLLM's: how many tokens have a logprob >= its).
    prompt_ranks: list[int] | None = None
    # Which of the request's n choices this is (0 to n - 1); every choice's output has the request's id.
    index: int = 0
    # With finish reason "error" where the engine knows why (a grammar that failed to compile, ...); else None.
    error: str | None = None
    # Prompt tokens taken from the prefix cache instead of computed (the latest admission's; OpenAI's
    # usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
