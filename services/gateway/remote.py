"""gRPC forms of the gateway's backends: an engine process (shinkai.v1, token ids only) and the tokenizer
service (tokenizer.v1). Status codes come back as the exceptions the in-process backends raise, so the
`Frontend` treats both alike: INVALID_ARGUMENT → ValueError / ChatError, RESOURCE_EXHAUSTED → QueueFull,
UNAVAILABLE → ShuttingDown.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import grpc

from observability import tracing
from services import service_auth
from services.engine.finish_reason import FinishReason
from services.engine.images.prompt import ImageEncoderUnavailable
from services.engine.sampling_params import SamplingParams
from services.engine.service import Delta, QueueFull, ShuttingDown
from services.engine.stats import EngineStats
from services.gateway.backends import DetokenizerLost
from services.gateway.errors import ERROR_CODE_KEY
from services.proto.shinkai.v1 import shinkai_pb2 as pb
from services.proto.shinkai.v1 import shinkai_pb2_grpc
from services.proto.tokenizer.v1 import tokenizer_pb2 as tpb
from services.proto.tokenizer.v1 import tokenizer_pb2_grpc
from services.tokenizer.chat import ChatError, RenderedChat

REASONS = {
    pb.FINISH_REASON_STOP: FinishReason.STOP,
    pb.FINISH_REASON_LENGTH: FinishReason.LENGTH,
    pb.FINISH_REASON_ABORT: FinishReason.ABORT,
    pb.FINISH_REASON_PREEMPTED: FinishReason.PREEMPTED,
    pb.FINISH_REASON_ERROR: FinishReason.ERROR,
}


def _raise_for(err: grpc.aio.AioRpcError, replica: str) -> None:
    code, details = err.code(), err.details() or ""
    if dict(err.trailing_metadata() or ()).get(ERROR_CODE_KEY) == "multimodal_unavailable":
        raise ImageEncoderUnavailable(details) from None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        raise ValueError(details) from None
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        raise QueueFull(0) from None
    if code == grpc.StatusCode.UNAVAILABLE:  # draining, its worker gone, or the multimodal service down
        raise ShuttingDown(f"engine {replica} cannot serve the request: {details}") from None
    raise err


def _sampling(params: SamplingParams) -> pb.SamplingParams:
    s = pb.SamplingParams(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.max_tokens is not None:
        s.max_tokens = params.max_tokens
    if params.seed is not None:
        s.seed = params.seed
    if params.logprobs is not None:
        s.logprobs = params.logprobs
    if params.n != 1:
        s.n = params.n
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if getattr(params, name) != off:
            setattr(s, name, getattr(params, name))
    if params.min_tokens:
        s.min_tokens = params.min_tokens
    if params.min_p:
        s.min_p = params.min_p
    if params.prompt_logprobs is not None:
        s.prompt_logprobs = params.prompt_logprobs
    if params.cache_salt is not None:
        s.cache_salt = params.cache_salt
    for token_id, value in params.logit_bias:
        s.logit_bias[token_id] = value
    for token_id in params.banned_token_ids:
        s.logit_bias[token_id] = -100.0  # a ban: services/gateway/grpc_api.py `_logit_bias` reads it back
    if params.constraint is not None:
        c = params.constraint
        s.constraint.CopyFrom(pb.OutputConstraint(kind=c.kind, spec=c.spec, strict=c.strict))
    return s


def _tops(tops: Any) -> list[list[tuple[int, float]]]:
    return [[(e.token_id, e.logprob) for e in t.entries] for t in tops]


class RemoteStream:
    """Deltas of one Generate call; ``close()`` cancels the call, which aborts the request on the engine."""

    def __init__(self, call: Any, first: pb.GenerateResponse, prompt_logprobs: bool = False) -> None:
        self.call = call
        # The request asked for prompt logprobs: each choice's first chunk carries them (maybe none: a
        # one-token prompt has no position to score, which a repeated field cannot tell from unset).
        self._prompt_logprobs_due: set[int] | None = set() if prompt_logprobs else None
        self._first: pb.GenerateResponse | None = first  # read by submit to surface errors early
        self._done = False
        self._cancelled = False  # close() cancelled the call: the next delta is the final "abort"
        self._num_output_tokens = 0  # as of the latest chunk, for a final this side has to make
        # The prompt as the engine queued it (image spans expanded): every chunk and the final carry it.
        self.num_prompt_tokens = (
            first.chunk.num_prompt_tokens if first.WhichOneof("kind") == "chunk" else first.final.usage.prompt_tokens
        )

    def __aiter__(self) -> RemoteStream:
        return self

    def _final(self, reason: FinishReason) -> Delta:
        self._done = True
        return Delta([], [], None, self._num_output_tokens, finish_reason=reason, last=True)

    async def __anext__(self) -> Delta:
        if self._done:
            raise StopAsyncIteration
        if self._cancelled:
            return self._final(FinishReason.ABORT)
        if self._first is not None:
            response, self._first = self._first, None
        else:
            try:
                response = await self.call.read()
            except grpc.aio.AioRpcError as err:  # the engine went away mid-stream
                return self._final(
                    FinishReason.ERROR if err.code() != grpc.StatusCode.CANCELLED else FinishReason.ABORT
                )
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not self._cancelled or (task is not None and task.cancelling()):
                    raise  # our reader was cancelled, not just the call
                return self._final(FinishReason.ABORT)  # grpc.aio raises this for a call cancelled locally
            if response is grpc.aio.EOF:
                return self._final(FinishReason.ABORT if self._cancelled else FinishReason.ERROR)
        if response.WhichOneof("kind") == "final":
            f = response.final
            self._done = not f.more_choices
            return Delta(
                [],
                [],
                None,
                f.usage.completion_tokens,
                finish_reason=REASONS[f.finish_reason],
                stop_token_id=f.stop_token_id if f.HasField("stop_token_id") else None,
                index=f.index,
                last=not f.more_choices,
                num_cached_tokens=f.usage.cached_tokens,
            )
        c = response.chunk
        self._num_output_tokens = c.num_output_tokens
        delta = Delta(list(c.token_ids), list(c.logprobs), _tops(c.top_logprobs) or None, c.num_output_tokens)
        delta.index = c.index
        if self._prompt_logprobs_due is not None and c.index not in self._prompt_logprobs_due:
            self._prompt_logprobs_due.add(c.index)
            delta.prompt_logprobs = list(c.prompt_logprobs)
            delta.prompt_top_logprobs = _tops(c.prompt_top_logprobs)
            delta.prompt_ranks = list(c.prompt_ranks)
        return delta

    def close(self) -> None:
        """Cancels the call (the engine then aborts the request); a reader still reading gets "abort"."""
        if not self._done:
            self._cancelled = True
            self.call.cancel()


class RemoteEngine:
    def __init__(self, replica: str, address: str, service_token: str | None = None) -> None:
        self.replica = replica  # the engine instance's name
        self.address = address
        self.channel = service_auth.aio_channel(address, token=service_token)  # the stack's service credential
        self.stub = shinkai_pb2_grpc.ShinkaiStub(self.channel)

    async def submit(
        self,
        request_id: str,
        client_request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[bytes] = (),
        priority: int = 0,
        tenant: str = "",
    ) -> RemoteStream:
        request = pb.GenerateRequest(
            request_id=request_id,
            client_request_id=client_request_id,
            token_ids=pb.TokenIds(ids=list(prompt_token_ids)),
            sampling=_sampling(params),
            images=list(images),
            priority=priority,
            tenant=tenant,
        )
        call = self.stub.Generate(request, metadata=tracing.grpc_metadata())  # the request span's context
        try:
            first = await call.read()  # an error status arrives here, before anything streams
        except grpc.aio.AioRpcError as err:
            _raise_for(err, self.replica)
        if first is grpc.aio.EOF:
            raise ShuttingDown(f"engine {self.replica} ended the stream without an answer")
        return RemoteStream(call, first, params.prompt_logprobs is not None)

    async def abort(self, client_request_id: str) -> bool:
        return (await self.stub.Abort(pb.AbortRequest(client_request_id=client_request_id), timeout=10)).found

    async def loads(self) -> dict[str, EngineStats]:
        loads = await self.stub.GetLoads(pb.GetLoadsRequest(), timeout=10)
        return {
            e.replica: EngineStats(
                free_blocks=e.num_free_blocks,
                total_blocks=e.num_total_blocks,
                free_state_slots=e.num_free_state_slots,
                total_state_slots=e.num_total_state_slots,
                num_waiting=e.num_waiting,
                num_running=e.num_running,
                decode_step=e.decode_step,
                num_queued=e.num_queued,
            )
            for e in loads.engines
        }

    async def model_info(self) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30, wait_for_ready=True)

    async def close(self) -> None:
        await self.channel.close()


class _RemoteDetokenizer:
    def __init__(self, stub: tokenizer_pb2_grpc.TokenizerStub, skip_special_tokens: bool = True) -> None:
        self.call = stub.Detokenize(metadata=tracing.grpc_metadata())
        self.keep_special_tokens = not skip_special_tokens  # sent with every message; the first one decides

    async def push(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return await self._exchange(
            tpb.DetokenizeRequest(token_ids=list(token_ids), keep_special_tokens=self.keep_special_tokens)
        )

    async def finish(self) -> str:
        text = await self._exchange(tpb.DetokenizeRequest(finish=True, keep_special_tokens=self.keep_special_tokens))
        try:
            await self.call.done_writing()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass  # the text is whole; the service went away after answering
        return text

    async def _exchange(self, request: tpb.DetokenizeRequest) -> str:
        """One request written and its answer read; DetokenizerLost when the stream broke (the service died)."""
        try:
            await self.call.write(request)
            response = await self.call.read()
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
            raise DetokenizerLost(f"the tokenizer service's Detokenize stream broke: {err}") from None
        if response is grpc.aio.EOF:
            raise DetokenizerLost("the tokenizer service's Detokenize stream ended")
        return response.text

    def close(self) -> None:
        self.call.cancel()


class RemoteTokenizer:
    """INVALID_ARGUMENT from the service is bad input (ChatError for chat, ValueError otherwise); any other
    failure means the service cannot answer now (ShuttingDown, a 503 / UNAVAILABLE)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = service_auth.aio_channel(address)  # the stack's service credential
        self.stub = tokenizer_pb2_grpc.TokenizerStub(self.channel)

    async def _call(self, method: Any, request: Any, bad_input: type[ValueError] = ValueError) -> Any:
        try:
            return await method(request, timeout=30, metadata=tracing.grpc_metadata())
        except grpc.aio.AioRpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise bad_input(err.details() or "the tokenizer refused the input") from None
            raise ShuttingDown(f"the tokenizer service at {self.address} failed: {err.code().name}") from None

    async def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        request = tpb.EncodeRequest(text=text, add_bos=True, max_tokens=max_tokens)
        return list((await self._call(self.stub.Encode, request)).token_ids)

    async def render_chat(
        self, body: dict[str, Any], max_tokens: int | None = None, protocol: str = "chat"
    ) -> RenderedChat:
        request = tpb.RenderChatRequest(body_json=json.dumps(body), max_tokens=max_tokens, protocol=protocol)
        reply = await self._call(self.stub.RenderChat, request, ChatError)
        return RenderedChat(list(reply.token_ids), reply.prompt, list(reply.image_urls))

    async def token_texts(self, token_ids: Sequence[int]) -> tuple[list[str], list[bytes]]:
        """Each id's own string and bytes, in one call (a logprobs request's tokens and top-n alternatives)."""
        if not token_ids:
            return [], []
        reply = await self._call(self.stub.Decode, tpb.DecodeRequest(token_ids=token_ids, each=True))
        return list(reply.texts), list(reply.token_bytes)

    def detokenizer(self, skip_special_tokens: bool = True) -> _RemoteDetokenizer:
        return _RemoteDetokenizer(self.stub, skip_special_tokens)

    async def close(self) -> None:
        await self.channel.close()
