"""The two things a `Frontend` talks to, and their in-process forms (used by `shinkai serve`).

- An *engine backend* queues token-id prompts (with the encoded images of their image placeholders) and
  streams `Delta`s: ``await submit(...)`` raises ValueError (bad input), QueueFull, ShuttingDown or
  ImageEncoderUnavailable before anything streams; the returned stream is an async iterator of deltas
  ending with the final one, whose ``close()`` aborts the request if it is live.
- A *tokenizer backend* encodes text, renders chat bodies (ids and image URLs) and makes per-request
  detokenizers.

Remote forms (gRPC to engine and tokenizer processes) live in `services/gateway/remote.py`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from services.engine.images.prompt import ImagePrompts
from services.engine.llm import LLM
from services.engine.sampling_params import SamplingParams
from services.engine.service import Delta, EngineService
from services.engine.stats import EngineStats
from services.tokenizer.budget import EncodePool, chat_content_bytes, check_bytes, check_tokens
from services.tokenizer.chat import ChatError, ChatRenderer, RenderedChat
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.token_bytes import TokenBytes


class DeltaStream(Protocol):
    num_prompt_tokens: int  # the prompt as the engine queued it (each image's span expanded)

    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def __anext__(self) -> Delta: ...

    def close(self) -> None: ...


class EngineBackend(Protocol):
    async def submit(
        self,
        request_id: str,
        client_request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[bytes] = (),
        priority: int = 0,
        tenant: str = "",
    ) -> DeltaStream: ...

    async def abort(self, client_request_id: str) -> bool: ...

    async def loads(self) -> dict[str, EngineStats]: ...  # replica -> its counts


class DetokenizerLost(Exception):
    """The detokenizer cannot answer any more (its service went away mid-stream): the request ends with finish
    reason error, its engine request aborted."""


class Detokenizer(Protocol):
    """push and finish raise DetokenizerLost when the text can no longer be made."""

    async def push(self, token_ids: Sequence[int]) -> str: ...

    async def finish(self) -> str: ...

    def close(self) -> None: ...


class TokenizerBackend(Protocol):
    """``max_tokens``: the most tokens the prompt may have (None: no limit); past it, ValueError (ChatError for
    chat), decided from the text's bytes alone when they prove it (services/tokenizer/budget.py)."""

    async def encode(self, text: str, max_tokens: int | None = None) -> list[int]: ...

    async def render_chat(
        self, body: dict[str, Any], max_tokens: int | None = None, protocol: str = "chat"
    ) -> RenderedChat: ...  # protocol: services/tokenizer/chat.py PROTOCOLS

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer: ...  # False: special tokens kept

    # Each id's string (special tokens kept) and its own bytes (services/tokenizer/token_bytes.py).
    async def token_texts(self, token_ids: Sequence[int]) -> tuple[list[str], list[bytes]]: ...


class LocalEngine:
    """An `EngineService` in this process; ``images`` plans and encodes image requests (None: refused)."""

    def __init__(self, service: EngineService, images: ImagePrompts | None = None) -> None:
        self.service = service
        self.images = images

    async def submit(
        self,
        request_id: str,
        client_request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        images: Sequence[bytes] = (),
        priority: int = 0,
        tenant: str = "",
    ) -> DeltaStream:
        """With images: the prompt is expanded and queued unready, and this waits for the embeddings (the
        request holds nothing meanwhile and other requests run); a failed encode, or a caller cancelled
        meanwhile, aborts the queued request before the error propagates, so nothing leaks."""
        if not images:
            stream = self.service.submit(
                request_id, client_request_id, prompt_token_ids, params, priority=priority, tenant=tenant
            )
            if params.constraint is not None:
                await self._compiled(stream, params)
            return stream
        prompts = self.images or ImagePrompts(None, None, None)
        ids, grids = prompts.expand(prompt_token_ids, images)
        stream = self.service.submit(
            request_id, client_request_id, ids, params, ready=False, priority=priority, tenant=tenant
        )
        try:
            rows = await prompts.embeddings(images, grids)
        except BaseException:
            stream.close()
            raise
        self.service.provide_images(request_id, rows)
        if params.constraint is not None:
            await self._compiled(stream, params)
        return stream

    async def _compiled(self, stream: DeltaStream, params: SamplingParams) -> None:
        """Waits for a queued constrained request's grammar (it holds nothing meanwhile, behind the readiness
        gate, and other requests run); a compile that fails or runs past the engine's limit aborts the request
        and raises ValueError (a 400), so no stream is ever returned for it."""
        structured = self.service.engine.structured
        assert params.constraint is not None
        compiling = structured.compiled(params.constraint)
        if compiling is None:  # the engine refused the constraint when it was queued
            return
        limit = structured.timeout_s
        try:
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(compiling)), limit)
        except TimeoutError:
            stream.close()
            raise ValueError(f"the grammar took over {limit:g} s to compile") from None
        except BaseException as err:
            stream.close()
            if isinstance(err, Exception):
                raise ValueError(f"the grammar failed to compile: {err}") from err
            raise

    async def abort(self, client_request_id: str) -> bool:
        return self.service.abort(client_request_id)

    async def loads(self) -> dict[str, EngineStats]:
        return {self.service.replica: self.service.stats()}


class _LocalDetokenizer:
    def __init__(self, inner: IncrementalDetokenizer) -> None:
        self.inner = inner

    async def push(self, token_ids: Sequence[int]) -> str:
        return self.inner.push(token_ids)

    async def finish(self) -> str:
        return self.inner.finish()

    def close(self) -> None:
        pass


class _NoText:
    """For an engine process: token ids only, the gateway's tokenizer makes the text."""

    async def push(self, token_ids: Sequence[int]) -> str:
        return ""

    async def finish(self) -> str:
        return ""

    def close(self) -> None:
        pass


class LocalTokenizer:
    """The model's tokenizer in this process; chat needs DeepSeek's V4.1 vocabulary (``chat`` None otherwise)."""

    def __init__(self, llm: LLM, chat: ChatRenderer | None, detokenize: bool = True) -> None:
        self.llm = llm
        self.chat = chat
        self.detokenize = detokenize  # False: streams carry no text
        # Encoding off the event loop that serves HTTP, gRPC and health (services/tokenizer/budget.py).
        self.pool = EncodePool(llm.tokenizer)
        self._token_bytes: TokenBytes | None = None  # each token's own bytes, built on the first call for them

    async def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        ids = await self.pool.encode(text, max_tokens)
        bos = self.llm.source.config.bos_token_id
        ids = ids if ids[:1] == [bos] else [bos, *ids]  # as LLM.encode
        check_tokens(len(ids), max_tokens)
        return ids

    async def render_chat(
        self, body: dict[str, Any], max_tokens: int | None = None, protocol: str = "chat"
    ) -> RenderedChat:
        if self.chat is None:
            raise ChatError(
                "chat rendering needs DeepSeek's V4.1 vocabulary; this model has its own: use /v1/completions"
            )
        num_bytes = chat_content_bytes(body)
        try:
            check_bytes(num_bytes, max_tokens, self.pool.token_bytes)
            rendered = await self.pool.run(num_bytes, self.chat.render, body, protocol)
            check_tokens(len(rendered.token_ids), max_tokens)
        except ChatError:
            raise
        except ValueError as err:
            raise ChatError(str(err)) from err
        return rendered

    async def token_texts(self, token_ids: Sequence[int]) -> tuple[list[str], list[bytes]]:
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.llm.tokenizer)
        strings = [self.llm.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]
        return strings, self._token_bytes(token_ids)

    def detokenizer(self, skip_special_tokens: bool = True) -> Detokenizer:
        if not self.detokenize:
            return _NoText()
        return _LocalDetokenizer(IncrementalDetokenizer(self.llm.tokenizer, skip_special_tokens))
