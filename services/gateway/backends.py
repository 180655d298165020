"""The two things a `Frontend` talks to, and their in-process forms (used by `shinkai serve`).

- An *engine backend* queues token-id prompts and streams `Delta`s: ``await submit(...)`` raises
  ValueError (bad input), QueueFull or ShuttingDown before anything streams; the returned stream is an
  async iterator of deltas ending with the final one, whose ``close()`` aborts the request if it is live.
- A *tokenizer backend* encodes text, renders chat bodies and makes per-request detokenizers.

Remote forms (gRPC to engine and tokenizer processes) live in `services/gateway/remote.py`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from services.engine.llm import LLM
from services.engine.sampling_params import SamplingParams
from services.engine.service import Delta, EngineService
from services.tokenizer.chat import ChatError, ChatRenderer
from services.tokenizer.detokenizer import IncrementalDetokenizer


class DeltaStream(Protocol):
    def __aiter__(self) -> AsyncIterator[Delta]: ...

    async def __anext__(self) -> Delta: ...

    def close(self) -> None: ...


class EngineBackend(Protocol):
    async def submit(self, client_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> DeltaStream: ...

    async def abort(self, client_id: str) -> bool: ...

    async def loads(self) -> list[dict[str, Any]]: ...


class Detokenizer(Protocol):
    async def push(self, token_ids: Sequence[int]) -> str: ...

    async def finish(self) -> str: ...

    def close(self) -> None: ...


class TokenizerBackend(Protocol):
    async def encode(self, text: str) -> list[int]: ...

    async def render_chat(self, body: dict[str, Any]) -> list[int]: ...

    def detokenizer(self) -> Detokenizer: ...

    async def token_strings(self, token_ids: Sequence[int]) -> list[str]: ...


class LocalEngine:
    """An `EngineService` in this process."""

    def __init__(self, service: EngineService) -> None:
        self.service = service

    async def submit(self, client_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> DeltaStream:
        return self.service.submit(client_id, prompt_token_ids, params)

    async def abort(self, client_id: str) -> bool:
        return self.service.abort(client_id)

    async def loads(self) -> list[dict[str, Any]]:
        return [dict(self.service.stats(), engine_id=self.service.name)]


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

    async def encode(self, text: str) -> list[int]:
        return self.llm.encode(text)

    async def render_chat(self, body: dict[str, Any]) -> list[int]:
        if self.chat is None:
            raise ChatError("chat rendering needs DeepSeek's V4.1 vocabulary; this model has its own: "
                            "use /v1/completions")
        return self.chat.render(body)[0]

    async def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self.llm.tokenizer.decode([t], skip_special_tokens=False) for t in token_ids]

    def detokenizer(self) -> Detokenizer:
        return _LocalDetokenizer(IncrementalDetokenizer(self.llm.tokenizer)) if self.detokenize else _NoText()
