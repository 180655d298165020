"""vLLM's utility endpoints: ``/tokenize`` and ``/detokenize`` (vLLM's request and response shapes), ``/version``.

``/tokenize`` takes a completion's ``prompt`` (encoded as a completion's prompt is: BOS first) or a chat's
``messages`` (rendered as a chat is, through deepseek-recipe, with the chat's own options: thinking, tools,
the developer role); it answers ``{"count", "max_model_len", "tokens", "token_strs"}``. ``/detokenize``
answers ``{"prompt"}`` for ``tokens``. Both check the key, answer errors as OpenAI bodies and run in a span
of the caller's trace, as generation does.
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request

from observability import tracing
from services.gateway import errors
from services.gateway.auth import Keys
from services.gateway.frontend import Frontend
from services.gateway.openai.chat_options import chat_options
from services.gateway.openai.json_body import read_json

# Fields of vLLM's TokenizeCompletionRequest / TokenizeChatRequest served here; anything else they name that asks
# for something is refused by name.
_REFUSED = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": None,
    "mm_processor_kwargs": None,
}


def version() -> str:
    """Shinkai's version: the installed package's, else the source tree's pyproject.toml."""
    try:
        return importlib.metadata.version("shinkai")
    except importlib.metadata.PackageNotFoundError:
        pyproject = Path(__file__).resolve().parents[3] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"]


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise errors.invalid(f"{name} must be a boolean", name)
    return value


def _token_ids(body: dict[str, Any], vocab_size: int | None) -> list[int]:
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise errors.invalid("tokens must be a list of integer token ids", "tokens")
    bad = [t for t in tokens if t < 0 or (vocab_size is not None and t >= vocab_size)]
    if bad:
        raise errors.invalid(f"token id {bad[0]} is outside the vocabulary", "tokens")
    return tokens


async def _tokenize(frontend: Frontend, body: dict[str, Any]) -> list[int]:
    for name, default in _REFUSED.items():
        if body.get(name) not in (None, default):
            raise errors.invalid(f"{name} is not served; the chat format is DeepSeek's own", name)
    frontend.check_model(body.get("model"))
    if "messages" in body:
        if _flag(body, "add_special_tokens", False):
            raise errors.invalid(
                "add_special_tokens: the chat format places its special tokens itself", "add_special_tokens"
            )
        try:
            rendered = await frontend.tokenizer.render_chat(chat_options(body).conversation)
        except ValueError as err:
            raise errors.invalid(str(err), "messages") from err
        return rendered.token_ids
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise errors.invalid("prompt must be a string (or send messages)", "prompt")
    if not _flag(body, "add_special_tokens", True):
        raise errors.invalid("add_special_tokens: a prompt is always encoded with BOS first", "add_special_tokens")
    try:
        return await frontend.tokenizer.encode(prompt)
    except ValueError as err:
        raise errors.invalid(str(err), "prompt") from err


def add_routes(app: FastAPI, frontend: Frontend, keys: Keys, max_body_bytes: int) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        keys.check(request.headers.get("authorization"))
        body = await read_json(request, max_body_bytes)
        with tracing.span("tokenize", tracing.extract(request.headers.items())):
            ids = await _tokenize(frontend, body)
            strings = (
                (await frontend.tokenizer.token_texts(ids))[0] if _flag(body, "return_token_strs", False) else None
            )
        return {"count": len(ids), "max_model_len": frontend.info.max_model_len, "tokens": ids, "token_strs": strings}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        keys.check(request.headers.get("authorization"))
        body = await read_json(request, max_body_bytes)
        frontend.check_model(body.get("model"))
        ids = _token_ids(body, frontend.info.vocab_size)
        with tracing.span("detokenize", tracing.extract(request.headers.items())):
            detokenizer = frontend.tokenizer.detokenizer()
            try:
                text = await detokenizer.push(ids) + await detokenizer.finish()
            finally:
                detokenizer.close()
        return {"prompt": text}

    @app.get("/version")
    async def get_version() -> dict[str, str]:
        return {"version": version()}
