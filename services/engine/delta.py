"""What one request gained in one step: the item of its ``RequestStream``, the service's answer to the APIs."""

from __future__ import annotations

from dataclasses import dataclass

from services.engine.finish_reason import FinishReason


@dataclass
class Delta:
    """What one request gained in one step."""

    # Tokens new since the previous delta.
    token_ids: list[int]
    # Logprob of each new token under the processed distribution (empty when the worker sampled none).
    logprobs: list[float]
    # Top-n (token id, logprob) pairs per new token, when the request asked for logprobs.
    top_logprobs: list[list[tuple[int, float]]] | None
    # Output tokens so far, these included.
    num_output_tokens: int
    # Set on the request's last delta only.
    finish_reason: FinishReason | None = None
    # The end or stop token that ended the request, if one did.
    stop_token_id: int | None = None
    # Which of the request's n choices gained (0 to n - 1); each choice's last delta has its finish_reason.
    index: int = 0
    # Set on the request's very last delta (its last unfinished choice's final one).
    last: bool = False
    # On a choice's first delta, when the request asked for prompt_logprobs: per prompt token after the first,
    # its logprob under the raw model (RequestOutput.prompt_logprobs); None otherwise.
    prompt_logprobs: list[float] | None = None
    # Alongside prompt_logprobs: per such token, the top-n (token id, logprob) pairs at its position.
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Alongside prompt_logprobs: per such token, its rank (vLLM's: how many tokens have a logprob >= its).
    prompt_ranks: list[int] | None = None
    # Prompt tokens taken from the prefix cache instead of computed (usage.prompt_tokens_details.cached_tokens).
    num_cached_tokens: int = 0
