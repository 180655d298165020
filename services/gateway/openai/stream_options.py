"""A completions or chat body's ``stream`` and ``stream_options``: OpenAI's ``include_usage`` (a last chunk with
the usage), vLLM's ``continuous_usage_stats`` (with include_usage, every chunk carries its choice's usage so far)
and OpenAI's ``include_obfuscation``, accepted either way (no padding field is sent). ``stream_options`` without
``stream: true`` is a 400, as OpenAI and vLLM answer; keys outside these are ignored with a logged warning."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from services.gateway import errors

log = logging.getLogger("shinkai.gateway")

KEYS = ("include_usage", "continuous_usage_stats", "include_obfuscation")


@dataclass(frozen=True)
class StreamOptions:
    stream: bool  # SSE chunks instead of one body
    include_usage: bool  # a last chunk with the usage
    continuous_usage: bool  # every chunk carries its choice's usage so far (only with include_usage)


def stream_options(body: dict[str, Any]) -> StreamOptions:
    stream = _boolean(body.get("stream"), "stream")
    options = body.get("stream_options")
    if options is None:
        return StreamOptions(stream, False, False)
    if not isinstance(options, dict):
        raise errors.invalid(f"stream_options must be an object, got {type(options).__name__}", "stream_options")
    if options and not stream:
        raise errors.invalid("stream_options is only allowed when stream is true", "stream_options")
    flags = {key: _boolean(options.get(key), f"stream_options.{key}") for key in KEYS}
    unknown = sorted(str(key) for key in set(options) - set(KEYS))
    if unknown:  # repr, each cut to 64 characters: a client's names cannot forge log lines
        log.warning("ignoring unknown stream_options: %s", ", ".join(repr(name[:64]) for name in unknown[:10]))
    include_usage = flags["include_usage"]
    return StreamOptions(stream, include_usage, include_usage and flags["continuous_usage_stats"])


def _boolean(value: Any, name: str) -> bool:
    if value is None:
        return False
    if not isinstance(value, bool):
        raise errors.invalid(f"{name} must be a boolean, got {type(value).__name__}", name)
    return value
