"""The public gRPC API, ``shinkai.v1.Shinkai``, on grpc.aio.

Requests arrive as raw bytes and are parsed here, so a malformed protobuf (truncated, invalid UTF-8 in a
string) is INVALID_ARGUMENT rather than grpc's INTERNAL "exception deserializing request". Every refusal is
a status code from `ApiError`; a cancelled Generate stream closes its `Generation`, which aborts it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf.message import DecodeError

from observability import tracing
from services.engine.finish_reason import FinishReason
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint
from services.gateway import errors
from services.gateway.auth import Keys, grpc_authorization, peer_host
from services.gateway.choices import merged_pieces
from services.gateway.errors import ApiError
from services.gateway.frontend import MAX_ID_BYTES, Frontend, GenerateArgs, finite_logprob
from services.gateway.grpc_chat import chat_delta, chat_request, content_bytes, message_content
from services.gateway.openai.chat_options import ChatOptions
from services.gateway.openai.chat_stream import ChatStream
from services.gateway.openai.json_body import DEFAULT_MAX_BODY_BYTES
from services.gateway.openai.protocol import MAX_N
from services.gateway.stop_strings import MAX_STOP_CHARS, MAX_STOP_STRINGS
from services.proto.shinkai.v1 import shinkai_pb2 as pb

SERVICE = "shinkai.v1.Shinkai"
# Caps on every string and repeated field of a request (INVALID_ARGUMENT naming the field past them). The
# request id comes back in every streamed message, so its cap also bounds what a stream repeats.
MAX_TEXT_BYTES = DEFAULT_MAX_BODY_BYTES  # text, and all chat contents together: the HTTP body limit
MAX_CHAT_MESSAGES = 4096  # chat.messages
MAX_ROLE_BYTES = 32  # chat.messages[].role
MAX_STOP_TOKEN_IDS = 1024  # sampling.stop_token_ids
MAX_LOGIT_BIAS_ENTRIES = 1024  # sampling.logit_bias, as vLLM's default

FINISH_REASONS = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
    FinishReason.PREEMPTED: pb.FINISH_REASON_PREEMPTED,
    FinishReason.ERROR: pb.FINISH_REASON_ERROR,
}


def _parse(message_type, raw: bytes):
    message = message_type()
    try:
        message.ParseFromString(raw)
    except DecodeError as err:
        raise errors.invalid(f"malformed {message_type.DESCRIPTOR.full_name}: {err}") from err
    return message


def _cap(name: str, size: int, limit: int, unit: str = "bytes") -> None:
    if size > limit:
        raise errors.invalid(f"{name} is {size} {unit}, over the limit of {limit}", name)


def check_caps(request: pb.GenerateRequest, max_model_len: int) -> None:
    """INVALID_ARGUMENT naming the first field over its cap; token_ids is capped by the context."""
    _cap("client_request_id", len(request.client_request_id.encode()), MAX_ID_BYTES)
    _cap("request_id", len(request.request_id.encode()), MAX_ID_BYTES)
    _cap("model", len(request.model.encode()), MAX_ID_BYTES)
    _cap("tenant", len(request.tenant.encode()), MAX_ID_BYTES)
    _cap("text", len(request.text.encode()), MAX_TEXT_BYTES)
    _cap("token_ids", len(request.token_ids.ids), max_model_len, "ids (the context)")
    _cap("chat.messages", len(request.chat.messages), MAX_CHAT_MESSAGES, "messages")
    for i, m in enumerate(request.chat.messages):
        _cap(f"chat.messages[{i}].role", len(m.role.encode()), MAX_ROLE_BYTES)
    _cap("chat.messages[].content", sum(content_bytes(m) for m in request.chat.messages), MAX_TEXT_BYTES)
    _cap("sampling.stop_token_ids", len(request.sampling.stop_token_ids), MAX_STOP_TOKEN_IDS, "ids")
    _cap("sampling.logit_bias", len(request.sampling.logit_bias), MAX_LOGIT_BIAS_ENTRIES, "entries")


def _logit_bias(logit_bias) -> tuple[tuple[int, ...], dict[int, float]]:
    """(the token ids logit_bias bans (-100, exactly), the other biases, added to their logits)."""
    banned, added = [], {}
    for token_id, value in sorted(logit_bias.items()):
        if not (math.isfinite(value) and -100 <= value <= 100):
            raise errors.invalid(
                f"sampling.logit_bias[{token_id}] must be a number from -100 to 100, got {value}", "sampling.logit_bias"
            )
        if value <= -100:
            banned.append(token_id)
        elif value != 0:
            added[token_id] = float(value)
    return tuple(banned), added


def _stop(sampling: pb.SamplingParams) -> tuple[str, ...]:
    stops = tuple(sampling.stop)
    if len(stops) > MAX_STOP_STRINGS:
        raise errors.invalid(f"sampling.stop holds {len(stops)} strings; at most {MAX_STOP_STRINGS}", "sampling.stop")
    if any(not stop or len(stop) > MAX_STOP_CHARS for stop in stops):
        raise errors.invalid(f"sampling.stop strings must be 1 to {MAX_STOP_CHARS} characters", "sampling.stop")
    return stops


def _args(request: pb.GenerateRequest) -> tuple[GenerateArgs, ChatOptions | None]:
    """The generation's arguments, and a chat prompt's options (None for text and token ids)."""
    options = None
    args = GenerateArgs(
        model=request.model or None,
        client_request_id=request.client_request_id or None,
        request_id=request.request_id or None,
        endpoint="grpc",
    )
    which = request.WhichOneof("prompt")
    if which == "text":
        args.prompt_text = request.text
    elif which == "token_ids":
        args.prompt_token_ids = list(request.token_ids.ids)
    elif which == "chat":
        options = chat_request(request.chat, [message_content(i, m) for i, m in enumerate(request.chat.messages)])
        args.chat_body = options.conversation
    else:
        raise errors.invalid("a prompt is required: set text, token_ids or chat", "prompt")
    if request.images and which != "token_ids":
        raise errors.invalid(
            "images go with token_ids (a gateway forwarding a chat); a client sends them as chat image_url parts",
            "images",
        )
    args.images = list(request.images)
    args.priority = request.priority
    args.tenant = request.tenant or None  # set by a gateway forwarding to an engine (Frontend refuses it otherwise)
    s = request.sampling
    args.stop = _stop(s)
    args.include_stop_str_in_output = s.include_stop_str_in_output
    args.skip_special_tokens = s.skip_special_tokens if s.HasField("skip_special_tokens") else True
    banned, bias = _logit_bias(s.logit_bias)
    if s.HasField("n") and not 1 <= s.n <= MAX_N:
        raise errors.invalid(f"sampling.n must be between 1 and {MAX_N}, got {s.n}", "sampling.n")
    try:
        args.params = SamplingParams(
            max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
            temperature=s.temperature if s.HasField("temperature") else 1.0,
            top_p=s.top_p if s.HasField("top_p") else 1.0,
            top_k=s.top_k if s.HasField("top_k") else -1,
            seed=s.seed if s.HasField("seed") else None,
            n=s.n if s.HasField("n") else 1,
            stop_token_ids=tuple(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            logprobs=s.logprobs if s.HasField("logprobs") else None,
            banned_token_ids=banned,
            logit_bias=bias,
            presence_penalty=s.presence_penalty if s.HasField("presence_penalty") else 0.0,
            frequency_penalty=s.frequency_penalty if s.HasField("frequency_penalty") else 0.0,
            repetition_penalty=s.repetition_penalty if s.HasField("repetition_penalty") else 1.0,
            min_tokens=s.min_tokens if s.HasField("min_tokens") else 0,
            min_p=s.min_p if s.HasField("min_p") else 0.0,
            prompt_logprobs=s.prompt_logprobs if s.HasField("prompt_logprobs") else None,
            cache_salt=s.cache_salt if s.HasField("cache_salt") else None,
            constraint=_constraint(s, options),
        )
    except ValueError as err:
        raise errors.invalid(str(err)) from err
    return args, options


def _tops(out, tops: list[list[tuple[int, float]]]) -> None:
    """Appends per token its top-n (token id, logprob) pairs to a repeated TokenTopLogprobs field."""
    for top in tops:
        out.add(entries=[pb.TopLogprob(token_id=i, logprob=finite_logprob(v)) for i, v in top])


def _constraint(sampling: pb.SamplingParams, options: ChatOptions | None) -> Constraint | None:
    """``sampling.constraint`` parsed (so a bad one is INVALID_ARGUMENT naming it before anything is queued), or a
    chat's tool-call grammar (tool_choice "required" or a function's name)."""
    tool_calls = options.constraint if options is not None else None
    if not sampling.HasField("constraint"):
        return tool_calls
    if tool_calls is not None:
        raise errors.invalid(
            "sampling.constraint cannot be combined with chat.tool_choice 'required' or a function's name",
            "sampling.constraint",
        )
    c = sampling.constraint
    if c.kind == "json_object" and c.spec:
        raise errors.invalid(
            "sampling.constraint: json_object takes no spec (a schema goes with kind json_schema)",
            "sampling.constraint",
        )
    try:
        constraint = Constraint(c.kind, c.spec, strict=c.strict)
        constraint.grammar()
    except ValueError as err:
        raise errors.invalid(f"sampling.constraint: {err}", "sampling.constraint") from err
    return constraint


class ShinkaiApi:
    def __init__(
        self,
        frontend: Frontend,
        is_ready: Callable[[], bool] = lambda: True,
        problem: Callable[[], str | None] = lambda: None,
        keys: Keys | None = None,
    ) -> None:
        self.frontend = frontend
        self.keys = keys or Keys()  # API keys; none: open
        self.is_ready = is_ready
        self.problem = problem  # why it is not ready: "draining" or a dependency that is gone

    async def _abort_with(self, context: grpc.aio.ServicerContext, err: ApiError) -> None:
        await context.abort(err.kind.grpc_code, err.message, trailing_metadata=err.grpc_trailing_metadata())

    async def generate(self, raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        try:
            if not self.is_ready():
                why = self.problem()
                raise ApiError(
                    errors.UNAVAILABLE,
                    "the server is shutting down"
                    if why in (None, "draining")
                    else f"the server cannot serve now: {why}",
                )
            owner = self.keys.check(grpc_authorization(context))
            request = _parse(pb.GenerateRequest, raw)
            check_caps(request, self.frontend.info.max_model_len)
            args, options = _args(request)
            args.owner = owner
            args.client_address = peer_host(context.peer())
            args.trace_parent = tracing.extract(context.invocation_metadata())
            generations = await self.frontend.start_choices(args)
        except ApiError as err:
            await self._abort_with(context, err)
            return
        first = generations[0]
        ids = {"request_id": first.request_id, "client_request_id": first.client_request_id}
        # Per choice: a chat prompt's answer parser (None for text and token ids).
        chats = [
            ChatStream(options, g.request_id, self.frontend.served_model, g.created) if options is not None else None
            for g in generations
        ]
        num_open = len(generations)
        try:
            async for i, piece in merged_pieces(generations):
                d, chat = piece.delta, chats[i]
                delta, called = pb.ChatDelta(), False
                if chat is not None:
                    chunks = chat.push(piece.text, len(d.token_ids))
                    if d.finish_reason is not None:
                        chunks += chat.finish(d.finish_reason)
                    delta, called = chat_delta(chunks)
                if d.token_ids or d.prompt_logprobs is not None or (piece.text and d.finish_reason is None):
                    # On the last delta the text (with the flush) travels in the final message instead.
                    chunk = pb.Chunk(
                        token_ids=d.token_ids,
                        text=piece.text if d.finish_reason is None else "",
                        logprobs=[finite_logprob(x) for x in d.logprobs],
                        num_prompt_tokens=first.num_prompt_tokens,
                        num_output_tokens=d.num_output_tokens,
                        index=i,
                    )
                    if d.finish_reason is None and chat is not None:
                        chunk.chat.CopyFrom(delta)
                    _tops(chunk.top_logprobs, d.top_logprobs or [])
                    if d.prompt_logprobs is not None:
                        chunk.prompt_logprobs.extend(finite_logprob(x) for x in d.prompt_logprobs)
                        _tops(chunk.prompt_top_logprobs, d.prompt_top_logprobs or [])
                        chunk.prompt_ranks.extend(d.prompt_ranks or [])
                    yield pb.GenerateResponse(**ids, chunk=chunk)
                if d.finish_reason is not None:
                    num_open -= 1
                    final = pb.Final(
                        finish_reason=FINISH_REASONS[d.finish_reason],
                        text=piece.text,
                        usage=pb.Usage(
                            prompt_tokens=first.num_prompt_tokens,
                            completion_tokens=d.num_output_tokens,
                            cached_tokens=d.num_cached_tokens,
                        ),
                        index=i,
                        more_choices=num_open > 0,
                    )
                    if d.stop_token_id is not None:
                        final.stop_token_id = d.stop_token_id
                    if chat is not None:
                        final.chat.CopyFrom(delta)
                        final.tool_calls = called
                    yield pb.GenerateResponse(**ids, final=final)
        finally:
            for generation, chat in zip(generations, chats):
                generation.close()  # a no-op after the final; aborts a cancelled stream
                if chat is not None:
                    chat.close()

    async def abort(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        try:
            owner = self.keys.check(grpc_authorization(context))
            request = _parse(pb.AbortRequest, raw)
            _cap("client_request_id", len(request.client_request_id.encode()), MAX_ID_BYTES)
        except ApiError as err:
            await self._abort_with(context, err)
            raise AssertionError("unreachable")
        return pb.AbortResponse(found=await self.frontend.abort(request.client_request_id, owner))

    async def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        try:
            self.keys.check(grpc_authorization(context))
        except ApiError as err:
            await self._abort_with(context, err)

    async def get_model_info(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        await self._authorize(context)
        return pb.ModelInfo(**dataclasses.asdict(self.frontend.info))

    async def get_loads(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.Loads:
        await self._authorize(context)
        loads = pb.Loads()
        for replica, s in (await self.frontend.loads()).items():
            loads.engines.add(
                replica=replica,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
                num_queued=s.num_queued,
                num_free_blocks=s.free_blocks,
                num_total_blocks=s.total_blocks,
                num_free_state_slots=s.free_state_slots,
                num_total_state_slots=s.total_state_slots,
                decode_step=s.decode_step,
            )
        return loads

    def handler(self) -> grpc.GenericRpcHandler:
        """Method handlers that take raw request bytes (no deserializer) and serialize protobuf responses."""

        def ser(message) -> bytes:
            return message.SerializeToString()

        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(self.generate, response_serializer=ser),
                "Abort": grpc.unary_unary_rpc_method_handler(self.abort, response_serializer=ser),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(self.get_model_info, response_serializer=ser),
                "GetLoads": grpc.unary_unary_rpc_method_handler(self.get_loads, response_serializer=ser),
            },
        )
