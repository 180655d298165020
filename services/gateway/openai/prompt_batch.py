"""A completions body whose ``prompt`` is a batch (several strings, or several lists of token ids), as OpenAI's and
vLLM's completions take it: one body per prompt, each parsed and queued as its own request. The answer holds
every prompt's choices in one list, prompt ``i``'s choice ``j`` at index ``i * n + j`` (OpenAI's and vLLM's order),
with one usage counting each prompt once."""

from __future__ import annotations

from typing import Any

from services.gateway import errors

MAX_PROMPTS = 128
"""Prompts per request, at most: each is a request of its own to the engine, the same bound as n's."""


def split_prompts(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The body once per prompt of its batch; the body itself when its prompt is one prompt (a string, a list of
    token ids or a batch of one), which the completions parser reads (and refuses, naming the field, if it is
    neither)."""
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or len(prompt) < 2 or not all(isinstance(p, (str, list)) for p in prompt):
        return [body]
    if len(prompt) > MAX_PROMPTS:
        raise errors.invalid(f"a batch of {len(prompt)} prompts is over the limit of {MAX_PROMPTS}", "prompt")
    return [dict(body, prompt=p) for p in prompt]
