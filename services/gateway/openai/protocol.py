"""OpenAI request bodies in, `GenerateArgs` out. Strict and explicit.

The body is parsed here, not by the framework (`services/gateway/openai/json_body.py`): bytes over the limit are a
413, bytes that are not UTF-8 or not JSON a 400, NaN/Infinity anywhere a 400 naming the field's path, a body
nested too deeply a 400, never a 500. Every field of OpenAI's and vLLM's request schemas is served or refused
naming it (services/gateway/openai/fields.py), never silently ignored; fields outside both are ignored with a
logged warning, as vLLM does; known fields of the wrong type or range are refused naming the field.
Lengths: a completion without ``max_tokens`` gets 16 tokens, a chat without ``max_tokens`` /
``max_completion_tokens`` leaves it unset (the rest of the context), as OpenAI and vLLM do.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass
from typing import Any

from services.engine.request_checks import check_priority
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint
from services.gateway import errors
from services.gateway.frontend import MAX_ID_BYTES, GenerateArgs
from services.gateway.openai import fields
from services.gateway.openai.chat_options import ChatOptions, chat_options
from services.gateway.openai.constraints import constraint_of
from services.gateway.openai.json_body import DEFAULT_MAX_BODY_BYTES, parse_body
from services.gateway.openai.stream_options import stream_options
from services.gateway.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS

__all__ = ["DEFAULT_MAX_BODY_BYTES", "OpenAIRequest", "parse_body", "parse_chat", "parse_completion"]

log = logging.getLogger("shinkai.gateway")

MAX_LOGPROBS = 20  # top-n logprobs per token, as vLLM's default max_logprobs
MAX_N = 128  # choices per request, as OpenAI's bound on n
COMPLETION_MAX_TOKENS = 16  # a completion's max_tokens when the body has none, as OpenAI and vLLM
# A logit_bias entry of this value (or below) bans the token: OpenAI's documented meaning of -100.
LOGIT_BIAS_BAN = -100
MAX_LOGIT_BIAS_ENTRIES = 1024  # as vLLM's default bound on logit_bias
_INT64 = (-(2**63), 2**63 - 1)
# Engine sampling fields taken from the body as they are, with their off value (vLLM's names and meanings).
ENGINE_FIELDS: dict[str, tuple[tuple[type, ...], Any]] = {
    "presence_penalty": ((int, float), 0.0),
    "frequency_penalty": ((int, float), 0.0),
    "repetition_penalty": ((int, float), 1.0),
    "min_tokens": ((int,), 0),
    "min_p": ((int, float), 0.0),
}


@dataclass
class OpenAIRequest:
    """A parsed OpenAI body."""

    args: GenerateArgs  # what to generate
    stream: bool  # SSE chunks instead of one body
    include_usage: bool  # stream_options.include_usage: a last chunk with usage
    num_logprobs: int | None  # top-n logprobs to return per token; None: no logprobs
    chat: ChatOptions | None = None  # a chat's conversation options; None for a completion
    echo: bool = False  # a completion's text starts with its prompt (with logprobs: its tokens' logprobs too)
    # The prompt text echo puts first: a text prompt's own; a token-id prompt's decoded (by the HTTP route).
    echo_text: str | None = None
    # vLLM's echo with max_tokens 0: the answer is the prompt alone (one token is generated and left out).
    echo_only: bool = False
    # vLLM's prompt_logprobs as the client asked (top-n per prompt position); None: not asked for. Echo with
    # logprobs has the engine compute them too, without this field in the answer.
    prompt_logprobs: int | None = None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens read "token_id:N"
    # vLLM's return_token_ids: choices carry their token_ids, the answer (streamed: its first chunk) the prompt's
    return_token_ids: bool = False
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far
    continuous_usage: bool = False


def _warn_unknown(body: dict[str, Any], endpoint: str) -> None:
    unknown = sorted(set(body) - fields.known(endpoint))
    if unknown:
        # repr, each cut to 64 characters: a client's field names cannot forge log lines or flood the log
        log.warning(
            "ignoring %d unknown fields of a %s request: %s",
            len(unknown),
            endpoint,
            ", ".join(repr(name[:64]) for name in unknown[:10]),
        )


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
    if isinstance(value, int) and not isinstance(value, bool) and not _INT64[0] <= value <= _INT64[1]:
        raise errors.invalid(f"{name} is out of range: {value}", name)
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise errors.invalid(f"{name} must be a list of integer token ids", name)
    return value


def _logit_bias(body: dict[str, Any], vocab_size: int | None) -> tuple[tuple[int, ...], dict[int, float]]:
    """(the token ids logit_bias bans, the other biases). OpenAI's values run from -100 to 100; -100 bans the
    token exactly (the sampler's ban list), any other value is added to its logit."""
    bias = _field(body, "logit_bias", (dict,), {}, "an object mapping token ids to numbers")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise errors.invalid(
            f"logit_bias has {len(bias)} entries, over the limit of {MAX_LOGIT_BIAS_ENTRIES}", "logit_bias"
        )
    banned, added = [], {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.lstrip("-").isdigit() and len(key) <= 19):
            raise errors.invalid(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")
        token_id = int(key)
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise errors.invalid(
                f"logit_bias token id {token_id} is outside the vocabulary"
                + (f" of {vocab_size}" if vocab_size is not None else ""),
                "logit_bias",
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
            raise errors.invalid(f"logit_bias[{key}] must be a number from -100 to 100, got {value!r}", "logit_bias")
        if value <= LOGIT_BIAS_BAN:
            banned.append(token_id)
        elif value != 0:
            added[token_id] = float(value)
    return tuple(sorted(banned)), added


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None or stop == "" or stop == []:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise errors.invalid("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise errors.invalid(f"stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise errors.invalid(f"a stop string is over {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _engine_fields(body: dict[str, Any]) -> dict[str, Any]:
    """The vLLM-named sampling fields that differ from off, for the engine's SamplingParams. One this engine's
    SamplingParams does not have is refused by name (never dropped)."""
    taken = SamplingParams.__dataclass_fields__
    out = {}
    for name, (types, off) in ENGINE_FIELDS.items():
        value = _field(body, name, types, off, "a number" if float in types else "an integer")
        if value == off:
            continue
        if name not in taken:
            raise errors.invalid(f"{name} is not served by this engine", name)
        out[name] = float(value) if float in types else value
    return out


def _choices(body: dict[str, Any]) -> int:
    n = _field(body, "n", (int,), 1, "an integer")
    if not 1 <= n <= MAX_N:
        raise errors.invalid(f"n must be between 1 and {MAX_N}, got {n}", "n")
    best_of = _field(body, "best_of", (int,), n, "an integer")
    if best_of != n:
        raise errors.invalid(f"best_of must equal n ({n}), got {best_of}: best-of sampling is not served", "best_of")
    return n


def _sampling(
    body: dict[str, Any],
    max_tokens_key: str,
    num_logprobs: int | None,
    logprobs_key: str,
    max_model_len: int,
    vocab_size: int | None,
    default_max_tokens: int | None,
    conversation: dict[str, Any] | None = None,
    tool_calls: Constraint | None = None,
) -> SamplingParams:
    max_tokens = _field(body, max_tokens_key, (int,), None, "a positive integer")
    if max_tokens is not None and not 1 <= max_tokens <= max_model_len:
        raise errors.invalid(
            f"{max_tokens_key} must be between 1 and the context of {max_model_len} tokens, got {max_tokens}",
            max_tokens_key,
        )
    if num_logprobs is not None and not 0 <= num_logprobs <= MAX_LOGPROBS:
        raise errors.invalid(f"{logprobs_key} must be between 0 and {MAX_LOGPROBS}, got {num_logprobs}", logprobs_key)
    n = _choices(body)
    constraint = constraint_of(body, conversation, tool_calls)
    temperature = _field(body, "temperature", (int, float), 1.0, "a number")
    top_p = _field(body, "top_p", (int, float), 1.0, "a number")
    top_k = _field(body, "top_k", (int,), -1, "an integer")
    seed = _field(body, "seed", (int,), None, "an integer")
    cache_salt = _field(body, "cache_salt", (str,), None, "a string")  # vLLM's: the prefix cache's salt
    stop_token_ids = _token_ids(body.get("stop_token_ids") or [], "stop_token_ids")
    for token_id in stop_token_ids:
        if not _INT64[0] <= token_id <= _INT64[1]:
            raise errors.invalid(f"stop_token_ids holds {token_id}, outside any vocabulary", "stop_token_ids")
    banned, bias = _logit_bias(body, vocab_size)
    try:
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            n=n,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=top_k,
            seed=seed,
            cache_salt=cache_salt,
            stop_token_ids=tuple(stop_token_ids),
            ignore_eos=_field(body, "ignore_eos", (bool,), False, "a boolean"),
            logprobs=num_logprobs,
            banned_token_ids=banned,
            logit_bias=bias,
            constraint=constraint,
            **_engine_fields(body),
        )
    except ValueError as err:  # SamplingParams' messages start with the field's name
        raise errors.invalid(str(err), str(err).split(" ", 1)[0].split("=", 1)[0]) from err


def _prompt_logprobs(body: dict[str, Any], stream: bool) -> int | None:
    """vLLM's prompt_logprobs (0 to 20 top entries per prompt position), refused with streaming as vLLM does."""
    num = _field(body, "prompt_logprobs", (int,), None, "an integer")
    if num is not None and not 0 <= num <= MAX_LOGPROBS:
        raise errors.invalid(f"prompt_logprobs must be between 0 and {MAX_LOGPROBS}, got {num}", "prompt_logprobs")
    if num is not None and stream:
        raise errors.invalid("prompt_logprobs are not available when stream is enabled", "prompt_logprobs")
    return num


def _common(body: dict[str, Any], args: GenerateArgs, endpoint: str) -> tuple[bool, bool]:
    """The fields both endpoints read beyond sampling; returns return_tokens_as_token_ids and return_token_ids."""
    fields.refuse_unserved(body, endpoint)
    args.stop = _stop(body)
    args.include_stop_str_in_output = _field(body, "include_stop_str_in_output", (bool,), False, "a boolean")
    args.skip_special_tokens = _field(body, "skip_special_tokens", (bool,), True, "a boolean")
    for name in ("user", "safety_identifier", "prompt_cache_key"):  # accepted as OpenAI documents them; unused
        _field(body, name, (str,), None, "a string")
    request_id = _field(body, "request_id", (str,), None, "a string")
    if request_id is not None:  # vLLM's body field: the client's name for the request, as X-Request-Id
        if not request_id or len(request_id.encode()) > MAX_ID_BYTES:
            raise errors.invalid(f"request_id must be 1 to {MAX_ID_BYTES} bytes", "request_id")
        args.client_request_id = request_id
    args.priority = _field(body, "priority", (int,), 0, "an integer")  # vLLM's: lower is served first
    try:
        check_priority(args.priority)
    except ValueError as err:
        raise errors.invalid(str(err), "priority") from err
    return (
        _field(body, "return_tokens_as_token_ids", (bool,), False, "a boolean"),
        _field(body, "return_token_ids", (bool,), False, "a boolean"),
    )


def parse_completion(body: dict[str, Any], max_model_len: int, vocab_size: int | None = None) -> OpenAIRequest:
    _warn_unknown(body, "completions")
    model = _field(body, "model", (str,), None, "a string")
    if model is None:
        raise errors.invalid("model is required", "model")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one (the HTTP route splits a larger batch: prompt_batch.py)
    args = GenerateArgs(model=model, endpoint="completions")
    if isinstance(prompt, str):
        args.prompt_text = prompt
    elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise errors.invalid("the prompt is empty", "prompt")
        args.prompt_token_ids = prompt
    else:
        raise errors.invalid("prompt must be a string or a list of token ids", "prompt")
    tokens_as_ids, return_token_ids = _common(body, args, "completions")
    num_logprobs = _field(body, "logprobs", (int,), None, "an integer")
    echo = _field(body, "echo", (bool,), False, "a boolean")
    echo_only = echo and body.get("max_tokens") == 0 and not isinstance(body.get("max_tokens"), bool)
    if echo_only:  # vLLM's scoring form: nothing generated is returned, so one token is enough
        body = dict(body, max_tokens=1)
    args.params = _sampling(
        body, "max_tokens", num_logprobs, "logprobs", max_model_len, vocab_size, COMPLETION_MAX_TOKENS
    )
    streaming = stream_options(body)
    prompt_logprobs = _prompt_logprobs(body, streaming.stream)
    engine_prompt_logprobs = prompt_logprobs
    if echo and num_logprobs is not None:  # OpenAI's echo with logprobs: the prompt tokens' logprobs lead
        engine_prompt_logprobs = max(prompt_logprobs or 0, num_logprobs)
    args.params = dataclasses.replace(args.params, prompt_logprobs=engine_prompt_logprobs)
    return OpenAIRequest(
        args,
        streaming.stream,
        streaming.include_usage,
        num_logprobs,
        echo=echo,
        echo_text=args.prompt_text if echo else None,
        echo_only=echo_only,
        tokens_as_ids=tokens_as_ids,
        return_token_ids=return_token_ids,
        prompt_logprobs=prompt_logprobs,
        continuous_usage=streaming.continuous_usage,
    )


def parse_chat(body: dict[str, Any], max_model_len: int, vocab_size: int | None = None) -> OpenAIRequest:
    _warn_unknown(body, "chat")
    model = _field(body, "model", (str,), None, "a string")
    if model is None:
        raise errors.invalid("model is required", "model")
    options = chat_options(body)
    args = GenerateArgs(model=model, endpoint="chat", chat_body=options.conversation)
    tokens_as_ids, return_token_ids = _common(body, args, "chat")
    num_logprobs = None
    if _field(body, "logprobs", (bool,), False, "a boolean"):
        num_logprobs = _field(body, "top_logprobs", (int,), 0, "an integer")
    elif _field(body, "top_logprobs", (int,), 0, "an integer"):
        raise errors.invalid("top_logprobs needs logprobs: true", "top_logprobs")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    args.params = _sampling(
        body,
        key,
        num_logprobs,
        "top_logprobs",
        max_model_len,
        vocab_size,
        None,
        options.conversation,
        options.constraint,
    )
    streaming = stream_options(body)
    prompt_logprobs = _prompt_logprobs(body, streaming.stream)
    args.params = dataclasses.replace(args.params, prompt_logprobs=prompt_logprobs)
    return OpenAIRequest(
        args,
        streaming.stream,
        streaming.include_usage,
        num_logprobs,
        chat=options,
        tokens_as_ids=tokens_as_ids,
        return_token_ids=return_token_ids,
        prompt_logprobs=prompt_logprobs,
        continuous_usage=streaming.continuous_usage,
    )
