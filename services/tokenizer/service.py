"""The tokenizer service: ``tokenizer.v1.Tokenizer`` over gRPC, plus grpc.health.v1.

``python -m services.entrypoints.tokenizer --model tiny --grpc-addr 127.0.0.1:0`` prints one JSON ready line with its
port. Bad input (a chat body the recipe refuses, ids outside the vocabulary, malformed protobuf) is
INVALID_ARGUMENT. SIGTERM stops taking calls (health NOT_SERVING) and lets live ones finish.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import prometheus_client as prom
from google.protobuf.message import DecodeError
from tokenizers import Tokenizer

from model.deepseek_v41.tokenizer import V41_VOCAB_SIZE, load_tokenizer, load_v41_tokenizer, v41_tokenizer_path
from observability import metrics as names
from observability import tracing
from services.proto.tokenizer.v1 import tokenizer_pb2 as pb
from services.tokenizer.budget import EncodePool, chat_content_bytes, check_bytes, check_tokens
from services.tokenizer.chat import ChatError, ChatRenderer
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.token_bytes import TokenBytes

SERVICE = "tokenizer.v1.Tokenizer"


def load_vocabulary(model: str) -> tuple[Tokenizer, int]:
    """The model's tokenizer and BOS id: DeepSeek V4.1's for a preset, the checkpoint's own otherwise."""
    from model.deepseek_v41.presets import PRESETS, preset

    if model in PRESETS:
        return load_v41_tokenizer(), preset(model).bos_token_id
    from model.deepseek_v41.config import load_config

    path = Path(model)
    return load_tokenizer(path), load_config(path).bos_token_id


class TokenizerApi:
    def __init__(self, tokenizer: Tokenizer, bos_token_id: int) -> None:
        self.registry = prom.CollectorRegistry()
        # Calls by method ("Encode", "RenderChat", "Decode", "Detokenize" messages).
        self.calls = prom.Counter(
            names.TOKENIZER_CALLS, "tokenizer calls by method", ["method"], registry=self.registry
        )
        self.tokenizer = tokenizer
        self._token_bytes: TokenBytes | None = None  # each token's own bytes, built on the first call for them
        self.bos_token_id = bos_token_id
        self.vocab_size = tokenizer.get_vocab_size()
        self.chat = ChatRenderer(v41_tokenizer_path()) if self.vocab_size == V41_VOCAB_SIZE else None
        # Encoding and chat rendering run here, never on the event loop that answers health and other calls.
        self.pool = EncodePool(tokenizer)

    async def warm(self) -> None:
        """The work a first call would pay once, done before the service says SERVING: the pool's threads, the
        tokenizer's first encode, the recipe's first chat rendering (~3 ms on a CPU core) and each token's bytes
        (for logprobs)."""
        await self.pool.encode("warm")
        if self.chat is not None:
            await self.pool.run(0, self.chat.render, {"messages": [{"role": "user", "content": "warm"}]})
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.tokenizer)
        IncrementalDetokenizer(self.tokenizer, True).push([self.bos_token_id])

    @staticmethod
    async def _parse(message_type, raw: bytes, context: grpc.aio.ServicerContext):
        message = message_type()
        try:
            message.ParseFromString(raw)
        except DecodeError as err:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed {message_type.DESCRIPTOR.full_name}: {err}"
            )
        return message

    async def _check_ids(self, ids, context: grpc.aio.ServicerContext) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"token id {bad[0]} is outside the vocabulary of {self.vocab_size}"
            )

    async def encode(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.EncodeResponse:
        request = await self._parse(pb.EncodeRequest, raw, context)
        self.calls.labels(method="Encode").inc()
        budget = request.max_tokens if request.HasField("max_tokens") else None
        try:
            with _span("tokenizer.Encode", context):
                ids = await self.pool.encode(request.text, budget)
            if request.add_bos and ids[:1] != [self.bos_token_id]:
                ids = [self.bos_token_id, *ids]
            check_tokens(len(ids), budget)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return pb.EncodeResponse(token_ids=ids)

    async def render_chat(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.RenderChatResponse:
        request = await self._parse(pb.RenderChatRequest, raw, context)
        self.calls.labels(method="RenderChat").inc()
        try:
            if self.chat is None:
                raise ChatError("chat rendering needs DeepSeek's V4.1 vocabulary; this model has its own")
            body = json.loads(request.body_json)
            if not isinstance(body, dict):
                raise ChatError("the chat body must be a JSON object")
            budget = request.max_tokens if request.HasField("max_tokens") else None
            num_bytes = chat_content_bytes(body)
            check_bytes(num_bytes, budget, self.pool.token_bytes)
            with _span("tokenizer.RenderChat", context):
                rendered = await self.pool.run(num_bytes, self.chat.render, body, request.protocol or "chat")
            check_tokens(len(rendered.token_ids), budget)
        except (ValueError, ChatError, RecursionError) as err:  # RecursionError: a body nested past the parser
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err) or "the chat body is nested too deeply")
        return pb.RenderChatResponse(
            token_ids=rendered.token_ids, prompt=rendered.prompt, image_urls=rendered.image_urls
        )

    async def decode(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.DecodeResponse:
        request = await self._parse(pb.DecodeRequest, raw, context)
        self.calls.labels(method="Decode").inc()
        await self._check_ids(request.token_ids, context)
        skip = request.skip_special_tokens
        if request.each:  # every id alone, in one call (logprobs' token strings and bytes)
            if self._token_bytes is None:
                self._token_bytes = TokenBytes(self.tokenizer)
            return pb.DecodeResponse(
                texts=[self.tokenizer.decode([t], skip_special_tokens=skip) for t in request.token_ids],
                token_bytes=self._token_bytes(request.token_ids),
            )
        return pb.DecodeResponse(text=self.tokenizer.decode(list(request.token_ids), skip_special_tokens=skip))

    async def detokenize(
        self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DetokenizeResponse]:
        detok: list[IncrementalDetokenizer] = []  # made with the first message, which says how
        # One span for the whole stream, never made current: a generator may be closed from another context.
        span = tracing.start_span(
            "tokenizer.Detokenize", tracing.extract(context.invocation_metadata()), kind=tracing.SpanKind.SERVER
        )
        try:
            async for response in self._detokenize(detok, requests, context):
                yield response
        finally:
            tracing.end(span)

    async def _detokenize(
        self, detok: list[IncrementalDetokenizer], requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.DetokenizeResponse]:
        async for raw in requests:
            request = await self._parse(pb.DetokenizeRequest, raw, context)
            self.calls.labels(method="Detokenize").inc()
            await self._check_ids(request.token_ids, context)
            if not detok:
                detok.append(IncrementalDetokenizer(self.tokenizer, not request.keep_special_tokens))
            text = detok[0].push(request.token_ids)
            if request.finish:
                text += detok[0].finish()
            yield pb.DetokenizeResponse(text=text)

    def handler(self) -> grpc.GenericRpcHandler:
        def ser(message) -> bytes:
            return message.SerializeToString()

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Encode": grpc.unary_unary_rpc_method_handler(self.encode, response_serializer=ser),
                "RenderChat": grpc.unary_unary_rpc_method_handler(self.render_chat, response_serializer=ser),
                "Decode": grpc.unary_unary_rpc_method_handler(self.decode, response_serializer=ser),
                "Detokenize": grpc.stream_stream_rpc_method_handler(self.detokenize, response_serializer=ser),
            },
        )


def _span(name: str, context: grpc.aio.ServicerContext):
    """A server span under the caller's trace context (from the call's metadata); a no-op when tracing is off."""
    return tracing.span(name, tracing.extract(context.invocation_metadata()), kind=tracing.SpanKind.SERVER)
