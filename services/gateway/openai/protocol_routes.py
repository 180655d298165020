"""``POST /v1/responses`` (OpenAI Responses) and ``POST /v1/messages`` (Anthropic Messages), plain or streamed.

Both go through `ProtocolStream` (deepseek-recipe's converters and response generators) and the same
`Frontend` as chat: the same key check (Anthropic clients send theirs as ``x-api-key``), OpenAI error bodies,
metrics (endpoint label "responses" / "messages") and request span, stop sequences on the text, and an abort
when the client goes away.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from observability import tracing
from services.engine.finish_reason import FinishReason
from services.gateway import errors
from services.gateway.auth import Keys
from services.gateway.errors import ApiError
from services.gateway.frontend import Frontend
from services.gateway.generation import Generation
from services.gateway.openai.disconnect import collect_while_connected
from services.gateway.openai.json_body import read_json
from services.gateway.openai.protocol_stream import ProtocolStream

_PREFIX = {"responses": "resp", "messages": "msg"}


def _authorization(request: Request) -> str | None:
    given = request.headers.get("authorization")
    key = request.headers.get("x-api-key")
    return given if given is not None or key is None else f"Bearer {key}"


def _sse(name: str | None, data: str) -> str:
    return (f"event: {name}\n" if name else "") + f"data: {data}\n\n"


async def _events(stream: ProtocolStream, generation: Generation) -> AsyncIterator[str]:
    try:
        for name, data in stream.ready(generation.num_prompt_tokens):
            yield _sse(name, data)
        async for piece in generation:
            events = stream.push(piece.text, len(piece.delta.token_ids))
            if piece.delta.finish_reason is not None:
                events += stream.finish(piece.delta.finish_reason)
            for name, data in events:
                yield _sse(name, data)
    finally:
        generation.close()
        stream.close()


def add_routes(
    app: FastAPI, frontend: Frontend, keys: Keys, max_body_bytes: int, check_ready: Callable[[], None]
) -> None:
    async def serve(request: Request, protocol: str) -> Response:
        owner = keys.check(_authorization(request))
        check_ready()
        body = await read_json(request, max_body_bytes)
        model = body.get("model")
        frontend.check_model(model if isinstance(model, str) else None)
        response_id = f"{_PREFIX[protocol]}_{uuid.uuid4().hex}"
        stream = ProtocolStream(protocol, body, frontend.served_model, response_id)
        args = stream.args(frontend.served_model)
        args.trace_parent = tracing.extract(request.headers.items())
        args.owner = owner
        args.client_address = request.client.host if request.client else None
        generation = await frontend.start(args)
        headers = {"X-Request-Id": generation.client_request_id}
        if stream.stream:
            return StreamingResponse(
                _events(stream, generation),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **headers},
            )
        try:
            collected = await collect_while_connected(request, [generation])
        finally:
            generation.close()
        if collected is None:
            stream.close()
            return Response(status_code=499)
        (pieces,) = collected
        stream.ready(generation.num_prompt_tokens)
        stream.push("".join(p.text for p in pieces), pieces[-1].delta.num_output_tokens)
        stream.finish(pieces[-1].delta.finish_reason or FinishReason.STOP)
        if stream.failure is not None and protocol == "messages":  # no stop_reason says it: an error answer
            kind = errors.INTERNAL if stream.failure == FinishReason.ERROR else errors.UNAVAILABLE
            raise ApiError(kind, stream.failure_message(), code=f"engine_{stream.failure}")
        return Response(stream.body_json(), media_type="application/json", headers=headers)

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await serve(request, "responses")

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await serve(request, "messages")
