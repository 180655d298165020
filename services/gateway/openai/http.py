"""The OpenAI-compatible HTTP API (FastAPI): completions and chat, each plain or SSE, with ``n`` choices; models,
health, metrics. Responses and Anthropic Messages: protocol_routes.py; /tokenize, /detokenize, /version:
tokenize.py.

Every error is an OpenAI error body with the status of its `ApiError` kind; unknown paths are 404 bodies
too, and an unexpected exception is logged and answered 500 (a bug, never the answer to bad input).
A streamed request whose client goes away is aborted: leaving the generator closes its `Generation`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from observability import tracing
from services.gateway import errors
from services.gateway.auth import Keys
from services.gateway.errors import ApiError
from services.gateway.frontend import MAX_ID_BYTES, Frontend
from services.gateway.generation import Generation
from services.gateway.openai import protocol_routes, tokenize
from services.gateway.openai.disconnect import collect_while_connected
from services.gateway.openai.formatter import Formatter, choice_pieces, request_usage
from services.gateway.openai.json_body import read_json
from services.gateway.openai.openapi import openapi_schema
from services.gateway.openai.prompt_batch import split_prompts
from services.gateway.openai.protocol import (
    DEFAULT_MAX_BODY_BYTES,
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

    @app.exception_handler(ClientDisconnect)
    async def _gone(_: Request, err: ClientDisconnect) -> Response:
        return Response(status_code=499)  # the client left (or its body timed out) mid-body: nobody reads this

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
        requests = [
            parse(one, info.max_model_len, info.vocab_size) for one in ([body] if chat else split_prompts(body))
        ]
        parsed = requests[0]
        client_request_id = _client_request_id(request)
        generations: list[Generation] = []
        fmts: list[Formatter] = []
        try:
            for parsed_one in requests:  # a completions batch: each prompt its own request, choices in order
                parsed_one.args.trace_parent = tracing.extract(request.headers.items())  # a caller's traceparent
                parsed_one.args.owner = owner
                parsed_one.args.client_address = request.client.host if request.client else None
                parsed_one.args.client_request_id = client_request_id or parsed_one.args.client_request_id
                if parsed_one.echo and parsed_one.echo_text is None:  # a token-id prompt's echo: its decoded text
                    args = parsed_one.args
                    parsed_one.echo_text = await _decoded(args.prompt_token_ids or [], args.skip_special_tokens)
                started = await frontend.start_choices(parsed_one.args)
                fmts += [Formatter(frontend, parsed_one, g, chat, first_index=len(generations)) for g in started]
                generations += started
        except BaseException:
            for generation in generations:
                generation.close()  # a later prompt was refused: the ones queued before it are aborted
            raise
        for fmt in fmts:  # a batch's answer is one response: the first prompt's request names it
            fmt.id = fmts[0].id
        # As vLLM: the caller's id, else the request's.
        id_header = {"X-Request-Id": generations[0].client_request_id}
        if parsed.stream:
            return StreamingResponse(
                _stream(fmts, parsed.include_usage, parsed.continuous_usage),
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
        body["usage"] = request_usage(
            fmts, sum(b["usage"]["completion_tokens"] for b in bodies), sum(fmt.num_reasoning_tokens for fmt in fmts)
        )
        return JSONResponse(body, headers=id_header)

    async def _decoded(token_ids: list[int], skip_special_tokens: bool) -> str:
        detokenizer = frontend.tokenizer.detokenizer(skip_special_tokens)
        try:
            return await detokenizer.push(token_ids) + await detokenizer.finish()
        finally:
            detokenizer.close()

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

    async def _stream(fmts: list[Formatter], include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        try:
            async for fmt, piece in choice_pieces(fmts):
                await fmt.resolve([*fmt.pending_pieces(), piece])
                for chunk in fmt.chunks(piece):
                    if continuous_usage:  # vLLM's continuous_usage_stats: the choice's usage so far
                        chunk["usage"] = fmt.usage(fmt.num_output_tokens, fmt.num_reasoning_tokens)
                    yield _sse(chunk)
            if include_usage:
                yield _sse(
                    fmts[0].usage_chunk(
                        request_usage(
                            fmts,
                            sum(fmt.num_output_tokens for fmt in fmts),
                            sum(fmt.num_reasoning_tokens for fmt in fmts),
                        )
                    )
                )
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
