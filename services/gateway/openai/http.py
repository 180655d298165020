"""The OpenAI-compatible HTTP API (FastAPI): completions and chat, each plain or SSE; models, health, metrics.

Every error is an OpenAI error body with the status of its `ApiError` kind; unknown paths are 404 bodies
too, and an unexpected exception is logged and answered 500 (a bug, never the answer to bad input).
A streamed request whose client goes away is aborted: leaving the generator closes its `Generation`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from observability import tracing
from services.engine.finish_reason import FinishReason
from services.gateway import errors
from services.gateway.auth import Keys
from services.gateway.errors import ApiError
from services.gateway.frontend import MAX_ID_BYTES, Frontend, finite_logprob
from services.gateway.generation import Generation, Piece
from services.gateway.openai import protocol_routes, tokenize
from services.gateway.openai.chat_stream import ChatStream
from services.gateway.openai.disconnect import collect_while_connected
from services.gateway.openai.json_body import read_json
from services.gateway.openai.openapi import openapi_schema
from services.gateway.openai.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    OpenAIRequest,
    parse_chat,
    parse_completion,
)
from services.gateway.probe import probe

log = logging.getLogger("shinkai.gateway")


def _json(body: dict[str, Any]) -> str:
    # allow_nan=False: a non-finite number is a bug that must fail loudly, never a response JSON.parse refuses.
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _sse(body: dict[str, Any] | str) -> str:
    return f"data: {body if isinstance(body, str) else _json(body)}\n\n"


class _Formatter:
    """Builds completions or chat bodies and chunks for one choice of a request."""

    def __init__(self, frontend: Frontend, request: OpenAIRequest, generation: Generation, chat: bool) -> None:
        self.frontend = frontend
        self.request = request
        self.generation = generation
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{generation.request_id}"  # as vLLM: the request's id inside
        self.object = "chat.completion" if chat else "text_completion"
        self._strings: dict[int, str] = {}  # token id -> its own string, for logprobs
        # A chat's reasoning / answer / tool-call parser (deepseek-recipe); None for a completion.
        self.chat_stream = (
            ChatStream(request.chat, self.id, frontend.served_model, generation.created)
            if request.chat is not None
            else None
        )
        self._pending: list[Piece] = []  # pieces whose logprobs no chat chunk has carried yet
        self.index = generation.index  # the choice's index in every body and chunk
        self.first = True  # no chunk of this choice was sent yet
        self.num_output_tokens = 0  # this choice's output tokens so far

    async def resolve(self, pieces: list[Piece]) -> None:
        """Looks up the strings of the pieces' tokens (only when logprobs were asked for)."""
        if self.request.num_logprobs is None:
            return
        ids = {t for p in pieces for t in p.delta.token_ids}
        ids |= {i for p in pieces for top in p.delta.top_logprobs or [] for i, _ in top}
        missing = sorted(ids - self._strings.keys())
        if missing and not self.request.tokens_as_ids:
            self._strings.update(zip(missing, await self.frontend.tokenizer.token_strings(missing)))

    def _token(self, token_id: int) -> str:
        if self.request.tokens_as_ids:
            return f"token_id:{token_id}"
        return self._strings.get(token_id, "")

    def logprobs(self, pieces: list[Piece]) -> dict[str, Any] | None:
        if self.request.num_logprobs is None:
            return None
        ids = [t for p in pieces for t in p.delta.token_ids]
        lps = [finite_logprob(x) for p in pieces for x in p.delta.logprobs]
        tops = [
            [(i, finite_logprob(v)) for i, v in top]
            for p in pieces
            for top in (p.delta.top_logprobs or [[] for _ in p.delta.token_ids])
        ]
        if self.chat:
            return {
                "content": [
                    {
                        "token": self._token(t),
                        "logprob": lp,
                        "bytes": None,
                        "top_logprobs": [{"token": self._token(i), "logprob": v, "bytes": None} for i, v in top],
                    }
                    for t, lp, top in zip(ids, lps, tops)
                ]
            }
        return {
            "tokens": [self._token(t) for t in ids],
            "token_logprobs": lps,
            "top_logprobs": [{self._token(i): v for i, v in top} for top in tops],
            "text_offset": [],
        }

    def usage(self, num_output_tokens: int) -> dict[str, int]:
        n = self.generation.num_prompt_tokens
        return {"prompt_tokens": n, "completion_tokens": num_output_tokens, "total_tokens": n + num_output_tokens}

    def body(self, pieces: list[Piece]) -> dict[str, Any]:
        text = "".join(p.text for p in pieces)
        final = pieces[-1].delta
        choice: dict[str, Any] = {
            "index": self.index,
            "logprobs": self.logprobs(pieces),
            "finish_reason": final.finish_reason,
        }
        if self.chat_stream is not None:
            self.chat_stream.push(text, final.num_output_tokens)
            self.chat_stream.finish(final.finish_reason or FinishReason.STOP)
            message, recipe_reason = self.chat_stream.message()
            choice["message"] = message
            if recipe_reason == "tool_calls" and final.finish_reason == FinishReason.STOP:
                choice["finish_reason"] = "tool_calls"
        else:
            choice["text"] = (self.generation_prompt() if self.request.echo else "") + text
        return {
            "id": self.id,
            "object": self.object,
            "created": self.generation.created,
            "model": self.frontend.served_model,
            "choices": [choice],
            "usage": self.usage(final.num_output_tokens),
        }

    def generation_prompt(self) -> str:
        return self.request.args.prompt_text or ""

    def _envelope(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.generation.created,
            "model": self.frontend.served_model,
        }

    def usage_chunk(self, num_output_tokens: int) -> dict[str, Any]:
        return dict(self._envelope(), choices=[], usage=self.usage(num_output_tokens))

    def chunks(self, piece: Piece) -> list[dict[str, Any]]:
        """The SSE chunks of one piece: a completion's one, or as many as the chat parser completes."""
        first, self.first = self.first, False
        self.num_output_tokens = piece.delta.num_output_tokens
        if self.chat_stream is None:
            text = (self.generation_prompt() if first and self.request.echo else "") + piece.text
            choice = {
                "index": self.index,
                "text": text,
                "logprobs": self.logprobs([piece]),
                "finish_reason": piece.delta.finish_reason,
            }
            return [dict(self._envelope(), choices=[choice])]
        if self.request.num_logprobs is not None:
            self._pending.append(piece)
        chunks = self.chat_stream.push(piece.text, len(piece.delta.token_ids))
        if piece.delta.finish_reason is not None:
            chunks += self.chat_stream.finish(piece.delta.finish_reason)
        for chunk in chunks:
            chunk["object"] = f"{self.object}.chunk"
            for choice in chunk["choices"]:
                choice["index"] = self.index
                if self._pending:
                    choice["logprobs"] = self.logprobs(self._pending)
                    self._pending = []
        return chunks

    def pending_pieces(self) -> list[Piece]:
        return self._pending


async def _pieces(fmts: list[_Formatter]) -> AsyncIterator[tuple[_Formatter, Piece]]:
    """Every choice's pieces as they come (one choice: in order, without tasks)."""
    if len(fmts) == 1:
        async for piece in fmts[0].generation:
            yield fmts[0], piece
        return
    queue: asyncio.Queue[tuple[_Formatter, Piece | BaseException | None]] = asyncio.Queue()

    async def pump(fmt: _Formatter) -> None:
        try:
            async for piece in fmt.generation:
                await queue.put((fmt, piece))
        except Exception as err:  # handed to the reader, which raises it
            await queue.put((fmt, err))
        await queue.put((fmt, None))

    tasks = [asyncio.ensure_future(pump(fmt)) for fmt in fmts]
    try:
        remaining = len(fmts)
        while remaining:
            fmt, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield fmt, item
    finally:
        for task in tasks:
            task.cancel()


def build_app(
    frontend: Frontend,
    *,
    is_ready: Callable[[], bool] = lambda: True,
    health_problem: Callable[[], str | None] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    keys: Keys | None = None,
) -> FastAPI:
    keys = keys or Keys()
    problem = health_problem or (lambda: None if is_ready() else "draining")
    app = FastAPI(title="Shinkai", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: openapi_schema(frontend.info)  # type: ignore[method-assign]  # bodies are parsed by hand

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, err: ApiError) -> JSONResponse:
        headers = err.http_headers()
        if err.kind.http_status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(err.openai_body(), status_code=err.kind.http_status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, err: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(err.status_code)
        body = ApiError(errors.INVALID, str(err.detail), code=code).openai_body()
        return JSONResponse(body, status_code=err.status_code, headers=err.headers)  # 405 keeps its Allow

    @app.exception_handler(Exception)
    async def _bug(_: Request, err: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return JSONResponse(
            ApiError(errors.INTERNAL, f"internal error: {type(err).__name__}").openai_body(), status_code=500
        )

    def check_ready() -> None:
        if not is_ready():
            why = problem()
            if why in (None, "draining"):
                raise ApiError(errors.UNAVAILABLE, "the server is shutting down", code="shutting_down")
            raise ApiError(errors.UNAVAILABLE, f"the server cannot serve now: {why}", code="unavailable")

    async def _generate(request: Request, chat: bool) -> Response:
        owner = keys.check(request.headers.get("authorization"))
        check_ready()
        body = await read_json(request, max_body_bytes)
        info = frontend.info
        parse = parse_chat if chat else parse_completion
        parsed = parse(body, info.max_model_len, info.vocab_size)
        parsed.args.trace_parent = tracing.extract(request.headers.items())  # a caller's W3C traceparent
        parsed.args.owner = owner
        parsed.args.client_request_id = _client_request_id(request) or parsed.args.client_request_id
        generations = await frontend.start_choices(parsed.args)
        fmts = [_Formatter(frontend, parsed, generation, chat) for generation in generations]
        # As vLLM: the caller's id, else the request's.
        id_header = {"X-Request-Id": generations[0].client_request_id}
        if parsed.stream:
            return StreamingResponse(
                _stream(fmts, parsed.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **id_header},
            )
        try:
            collected = await collect_while_connected(request, generations)
        finally:
            for generation in generations:
                generation.close()  # a no-op after the final delta; aborts when the client left
        if collected is None:
            return Response(status_code=499)  # nobody reads it: the client has gone
        bodies = []
        for fmt, pieces in zip(fmts, collected):
            await fmt.resolve(pieces)
            bodies.append(fmt.body(pieces))
        body = bodies[0]
        body["choices"] = [b["choices"][0] for b in bodies]
        body["usage"] = fmts[0].usage(sum(b["usage"]["completion_tokens"] for b in bodies))
        return JSONResponse(body, headers=id_header)

    def _client_request_id(request: Request) -> str | None:
        """The caller's own id for the request (the X-Request-Id header, which Abort then takes), or None."""
        given = request.headers.get("x-request-id")
        if given is None:
            return None
        if not given or len(given.encode()) > MAX_ID_BYTES:
            raise errors.invalid(
                f"X-Request-Id is {len(given.encode())} bytes; it must be 1 to {MAX_ID_BYTES}", "X-Request-Id"
            )
        return given

    async def _stream(fmts: list[_Formatter], include_usage: bool) -> AsyncIterator[str]:
        try:
            async for fmt, piece in _pieces(fmts):
                await fmt.resolve([*fmt.pending_pieces(), piece])
                for chunk in fmt.chunks(piece):
                    yield _sse(chunk)
            if include_usage:
                yield _sse(fmts[0].usage_chunk(sum(fmt.num_output_tokens for fmt in fmts)))
            yield _sse("[DONE]")
        finally:
            for fmt in fmts:
                fmt.generation.close()  # a no-op after the final delta; aborts on disconnect
                if fmt.chat_stream is not None:
                    fmt.chat_stream.close()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, chat=True)

    def _model_card() -> dict[str, Any]:
        return {
            "id": frontend.served_model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "shinkai",
            "max_model_len": frontend.info.max_model_len,
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        keys.check(request.headers.get("authorization"))
        return {"object": "list", "data": [_model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(request: Request, model: str) -> dict[str, Any]:
        keys.check(request.headers.get("authorization"))
        frontend.check_model(model)
        return _model_card()

    tokenize.add_routes(app, frontend, keys, max_body_bytes)
    protocol_routes.add_routes(app, frontend, keys, max_body_bytes, check_ready)

    @app.get("/health")
    async def health() -> Response:
        why = problem()
        if why is not None:
            return JSONResponse({"status": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: a real one-token generation through tokenizer-free token ids, engine and worker."""
        why = problem()
        if why is None:
            why = await probe(frontend)
        if why is not None:
            return JSONResponse({"status": why}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.exposition(), media_type="text/plain; version=0.0.4")

    return app
