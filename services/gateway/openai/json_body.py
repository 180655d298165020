"""A request body's bytes to a JSON object, with every refusal a 4xx that names what is wrong.

Invariants of a body this returns:
- it is a JSON object of at most ``MAX_DEPTH`` nested arrays/objects (the outermost object is depth 1);
- no number in it is NaN or ±Infinity, written so or too large for a float (``1e999``; Python's ``json``
  accepts those; a refusal names the field's path, e.g. ``messages[0].content``);
- no integer in it has more digits than Python converts (``sys.get_int_max_str_digits()``, 4,300 by default;
  beyond it ``int()`` raises ValueError): such a number is beyond every field's range, and the refusal names
  the field's path;
- every string in it is what the client sent: no sentinel value stands for a refused constant.
A body nested too deeply for the parser itself (a RecursionError) is the same 400 as one over ``MAX_DEPTH``.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fastapi import Request

from services.gateway import errors
from services.gateway.errors import ApiError

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# POST bodies must declare this type (a 415 otherwise): a cross-site form or text/plain POST never parses.
JSON_TYPE = "application/json"
# Nested arrays/objects a body may have; OpenAI bodies (tool schemas included) stay far below it.
MAX_DEPTH = 64


class _NonFinite:
    """What the parser makes of NaN / Infinity / -Infinity: an object no client value can equal."""

    def __init__(self, name: str) -> None:
        self.name = name  # the constant as written: "NaN", "Infinity" or "-Infinity"


class _TooLong:
    """What the parser makes of an integer with more digits than Python converts."""

    def __init__(self, digits: str) -> None:
        self.num_digits = len(digits.lstrip("-"))  # the integer's digits as written


def _parse_int(digits: str) -> int | _TooLong:
    try:
        return int(digits)
    except ValueError:  # over the int-string conversion limit: the parser's digits are always well-formed
        return _TooLong(digits)


def _parse_float(text: str) -> float | _NonFinite:
    value = float(text)
    return value if math.isfinite(value) else _NonFinite(text)


def _path(parts: tuple[str | int, ...]) -> str:
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


def check_tree(body: Any, max_depth: int = MAX_DEPTH) -> None:
    """Refuses a tree deeper than ``max_depth`` or holding a non-finite number or an integer past the conversion
    limit; iterative (no recursion)."""
    stack: list[tuple[Any, tuple[str | int, ...], int]] = [(body, (), 1)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, _NonFinite):
            raise errors.invalid(f"{_path(path)} must be a finite number, not {value.name}", _path(path) or None)
        if isinstance(value, _TooLong):
            raise errors.invalid(
                f"{_path(path)} is an integer of {value.num_digits} digits, beyond the range of any field",
                _path(path) or None,
            )
        if isinstance(value, (dict, list)):
            if depth > max_depth:
                raise errors.invalid(
                    f"the body is nested deeper than {max_depth} levels (at {_path(path)})", _path(path) or None
                )
            items = value.items() if isinstance(value, dict) else enumerate(value)
            stack.extend((v, (*path, k), depth + 1) for k, v in items)


def parse_json(text: str) -> Any:
    """JSON text parsed as `check_tree` expects (NaN / Infinity and over-long integers left as markers it
    refuses); ValueError when it is not JSON, RecursionError when nested too deeply for the parser."""
    return json.loads(text, parse_constant=_NonFinite, parse_int=_parse_int, parse_float=_parse_float)


def parse_body(raw: bytes, max_bytes: int = DEFAULT_MAX_BODY_BYTES, max_depth: int = MAX_DEPTH) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise ApiError(
            errors.TOO_LARGE, f"the body is {len(raw)} bytes, over the limit of {max_bytes}", code="body_too_large"
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise errors.invalid(f"the body is not valid UTF-8: byte {err.start} cannot be decoded") from err
    try:
        body = parse_json(text)
    except json.JSONDecodeError as err:
        raise errors.invalid(f"the body is not valid JSON: {err}") from err
    except RecursionError as err:
        raise errors.invalid(f"the body is nested deeper than {max_depth} levels") from err
    if not isinstance(body, dict):
        raise errors.invalid("the body must be a JSON object")
    check_tree(body, max_depth)
    return body


async def _read_body(request: Request, max_bytes: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise ApiError(
            errors.TOO_LARGE, f"the body is {declared} bytes, over the limit of {max_bytes}", code="body_too_large"
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise ApiError(errors.TOO_LARGE, f"the body is over the limit of {max_bytes} bytes", code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def read_json(request: Request, max_bytes: int = DEFAULT_MAX_BODY_BYTES) -> dict[str, Any]:
    """A POST's JSON object: 415 unless it is declared JSON, 413 over ``max_bytes``, 400 for bad JSON."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != JSON_TYPE:
        raise ApiError(
            errors.UNSUPPORTED_MEDIA,
            f"Content-Type must be {JSON_TYPE}, got {media_type or 'none'}",
            code="unsupported_media_type",
        )
    return parse_body(await _read_body(request, max_bytes), max_bytes)
