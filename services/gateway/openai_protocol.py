"""OpenAI request bodies in, `GenerateArgs` out; response and chunk bodies out. Strict and explicit.

The body is parsed here, not by the framework: bytes over the limit are a 413, bytes that are not UTF-8
or not JSON a 400, and NaN/Infinity (which Python's json accepts) a 400 naming the field, never a 500.
Unknown fields are ignored, as OpenAI's API does; known fields of the wrong type or range are refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from services.engine.sampling_params import SamplingParams
from services.gateway import errors
from services.gateway.errors import ApiError
from services.gateway.frontend import GenerateArgs

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
MAX_N = 1  # completions per prompt; parallel sampling comes later
_NON_FINITE = "__shinkai_non_finite__"


@dataclass
class OpenAIRequest:
    """A parsed OpenAI body."""

    args: GenerateArgs  # what to generate
    stream: bool  # SSE chunks instead of one body
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    num_logprobs: int | None  # top-n logprobs to return per token; None: no logprobs


def parse_body(raw: bytes, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise ApiError(errors.TOO_LARGE, f"the body is {len(raw)} bytes, over the limit of {max_bytes}",
                       code="body_too_large")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise errors.invalid(f"the body is not valid UTF-8: byte {err.start} cannot be decoded") from err
    try:
        body = json.loads(text, parse_constant=lambda name: _NON_FINITE)
    except json.JSONDecodeError as err:
        raise errors.invalid(f"the body is not valid JSON: {err}") from err
    if not isinstance(body, dict):
        raise errors.invalid("the body must be a JSON object")
    for key, value in body.items():
        if value == _NON_FINITE:
            raise errors.invalid(f"{key} must be a finite number, not NaN or Infinity", key)
    return body


def _field(body: dict[str, Any], name: str, types: tuple[type, ...], default: Any, what: str) -> Any:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in types:
        raise errors.invalid(f"{name} must be {what}, got {value!r}", name)
    if not isinstance(value, types):
        raise errors.invalid(f"{name} must be {what}, got {type(value).__name__}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise errors.invalid(f"{name} must be a finite number", name)
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise errors.invalid(f"{name} must be a list of integer token ids", name)
    return value


def _sampling(body: dict[str, Any], max_tokens_key: str, num_logprobs: int | None,
              max_model_len: int) -> SamplingParams:
    max_tokens = _field(body, max_tokens_key, (int,), None, "a positive integer")
    if max_tokens is not None and not 1 <= max_tokens <= max_model_len:
        raise errors.invalid(f"{max_tokens_key} must be between 1 and the context of {max_model_len} tokens, "
                             f"got {max_tokens}", max_tokens_key)
    n = _field(body, "n", (int,), 1, "an integer")
    if not 1 <= n <= MAX_N:
        raise errors.invalid(f"n must be between 1 and {MAX_N}, got {n}", "n")
    stop = body.get("stop")
    if stop not in (None, [], ""):
        raise errors.invalid("stop strings are not supported yet; use stop_token_ids", "stop")
    for name in ("frequency_penalty", "presence_penalty"):
        if _field(body, name, (int, float), 0, "a number") != 0:
            raise errors.invalid(f"{name} is not supported yet; leave it at 0", name)
    temperature = _field(body, "temperature", (int, float), 1.0, "a number")
    top_p = _field(body, "top_p", (int, float), 1.0, "a number")
    top_k = _field(body, "top_k", (int,), -1, "an integer")
    seed = _field(body, "seed", (int,), None, "an integer")
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p), top_k=top_k, seed=seed,
            stop_token_ids=tuple(_token_ids(body.get("stop_token_ids") or [], "stop_token_ids")),
            ignore_eos=_field(body, "ignore_eos", (bool,), False, "a boolean"), logprobs=num_logprobs,
        )
    except ValueError as err:
        raise errors.invalid(str(err), str(err).split(" ", 1)[0]) from err


def _stream_options(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _field(body, "stream", (bool,), False, "a boolean")
    options = _field(body, "stream_options", (dict,), {}, "an object")
    return stream, bool(options.get("include_usage", False))


def parse_completion(body: dict[str, Any], max_model_len: int) -> OpenAIRequest:
    model = _field(body, "model", (str,), None, "a string")
    if model is None:
        raise errors.invalid("model is required", "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    args = GenerateArgs(model=model, endpoint="completions")
    if isinstance(prompt, str):
        args.prompt_text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise errors.invalid("the prompt is empty", "prompt")
        args.prompt_token_ids = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise errors.invalid(f"a batch of {len(prompt)} prompts is not supported; send one prompt per request",
                             "prompt")
    else:
        raise errors.invalid("prompt must be a string or a list of token ids", "prompt")
    if _field(body, "echo", (bool,), False, "a boolean"):
        raise errors.invalid("echo is not supported", "echo")
    num_logprobs = _field(body, "logprobs", (int,), None, "an integer")
    args.params = _sampling(body, "max_tokens", num_logprobs, max_model_len)
    stream, include_usage = _stream_options(body)
    return OpenAIRequest(args, stream, include_usage, num_logprobs)


def parse_chat(body: dict[str, Any], max_model_len: int) -> OpenAIRequest:
    model = _field(body, "model", (str,), None, "a string")
    if model is None:
        raise errors.invalid("model is required", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise errors.invalid("messages must be a non-empty list", "messages")
    args = GenerateArgs(model=model, endpoint="chat", chat_body=body)
    num_logprobs = None
    if _field(body, "logprobs", (bool,), False, "a boolean"):
        num_logprobs = _field(body, "top_logprobs", (int,), 0, "an integer")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    args.params = _sampling(body, key, num_logprobs, max_model_len)
    stream, include_usage = _stream_options(body)
    return OpenAIRequest(args, stream, include_usage, num_logprobs)
