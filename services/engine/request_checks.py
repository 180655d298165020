"""What makes a request acceptable to an engine of a given vocabulary and config, and the engine's ids of a
request's choices."""

from __future__ import annotations

from collections.abc import Sequence

from services.engine.config import EngineConfig
from services.engine.sampling_params import SamplingParams


def validate_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, vocab_size: int, config: EngineConfig
) -> None:
    """Raises ValueError naming what is wrong with a request for an engine of this vocabulary and config."""
    if len(prompt_token_ids) == 0:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary of {vocab_size}")
    for name, ids in (
        ("stop_token_ids", params.stop_token_ids),
        ("banned_token_ids", params.banned_token_ids),
        ("forced_token_ids", params.forced_token_ids),
        ("logit_bias", tuple(t for t, _ in params.logit_bias)),
    ):
        if any(not 0 <= t < vocab_size for t in ids):
            raise ValueError(f"{name} has an id outside the vocabulary of {vocab_size}")
    if params.forced_token_ids and config.num_speculative_tokens:
        raise ValueError(
            "forced_token_ids cannot be combined with speculative decoding yet (num_speculative_tokens > 0)"
        )
    if (params.has_penalties or params.min_p) and config.num_speculative_tokens:
        raise ValueError(
            "presence_penalty, frequency_penalty, repetition_penalty and min_p cannot be combined with speculative "
            "decoding yet (num_speculative_tokens > 0)"
        )
    if params.prompt_logprobs is not None and config.num_speculative_tokens:
        raise ValueError(
            "prompt_logprobs cannot be combined with speculative decoding yet (num_speculative_tokens > 0)"
        )
    if params.max_tokens is None:
        if len(prompt_token_ids) >= config.max_model_len:
            raise ValueError(
                f"the prompt ({len(prompt_token_ids)} tokens) leaves no room for output in the context of "
                f"{config.max_model_len} tokens"
            )
        return
    total = len(prompt_token_ids) + params.max_tokens
    if total > config.max_model_len:
        raise ValueError(
            f"the prompt ({len(prompt_token_ids)} tokens) plus max_tokens ({params.max_tokens}) is "
            f"{total}, longer than the context of {config.max_model_len} tokens"
        )


def choice_id(request_id: str, index: int | None) -> str:
    """The engine's id of choice ``index`` of a request with n > 1 (None: its prefix); "\x1f" never occurs in the
    ids the gateway and LLM give."""
    return f"{request_id}\x1f{'prefix' if index is None else index}"


PRIORITY_RANGE = (-(2**31), 2**31 - 1)
"""A request's priority is an int32 (the gRPC field's type; the scheduler's ``QueueOrder``)."""


def check_priority(priority: int) -> None:
    """Raises ValueError unless ``priority`` is an int32."""
    if (
        isinstance(priority, bool)
        or not isinstance(priority, int)
        or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]
    ):
        raise ValueError(f"priority must be an integer in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], got {priority!r}")
