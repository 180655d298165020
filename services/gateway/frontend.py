"""What HTTP and gRPC share: model check, prompt encoding, submission to an engine, detokenized streams.

Both protocols turn their request into a `GenerateArgs`, call `Frontend.start` (which raises `ApiError`
before anything is queued) and read `Piece`s from the returned `Generation` until the final one.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from services.engine.llm import LLM
from services.engine.sampling_params import SamplingParams
from services.engine.service import Delta, EngineService, QueueFull, RequestStream, ShuttingDown
from services.gateway import errors
from services.gateway.errors import ApiError
from services.gateway.metrics import GatewayMetrics
from services.tokenizer.chat import ChatError, ChatRenderer
from services.tokenizer.detokenizer import IncrementalDetokenizer


@dataclass
class GenerateArgs:
    """One generation request, protocol-neutral. Exactly one of the three prompt forms is set."""

    # Requested model name; None means the served one.
    model: str | None
    # Plain text, encoded with BOS like `LLM.generate`.
    prompt_text: str | None = None
    # Token ids, used as given.
    prompt_token_ids: list[int] | None = None
    # An OpenAI chat body (its conversation keys), rendered through deepseek-recipe.
    chat_body: dict[str, Any] | None = None
    # Validated sampling parameters.
    params: SamplingParams = SamplingParams()
    # The client's request id; None: one is made.
    client_id: str | None = None
    # Which API this came through (a metrics label).
    endpoint: str = "generate"


@dataclass
class Piece:
    """One delta of a generation with its text."""

    delta: Delta
    # Text new in this delta; never splits a UTF-8 character. On the final piece it includes the flush.
    text: str


class Generation:
    """A started request's pieces. ``close()`` (or leaving ``async for`` early and closing) aborts it."""

    def __init__(self, frontend: Frontend, stream: RequestStream, detokenizer: IncrementalDetokenizer,
                 client_id: str, num_prompt_tokens: int, endpoint: str) -> None:
        self.frontend = frontend
        self.stream = stream
        self.detokenizer = detokenizer
        self.client_id = client_id  # the id Abort takes
        self.num_prompt_tokens = num_prompt_tokens
        self.endpoint = endpoint
        self.created = int(time.time())
        self._start = time.monotonic()
        self._last: float | None = None  # time of the latest token-bearing delta
        self.finish_reason: str | None = None

    def __aiter__(self) -> Generation:
        return self

    async def __anext__(self) -> Piece:
        try:
            delta = await self.stream.__anext__()
        except StopAsyncIteration:
            raise
        now = time.monotonic()
        metrics = self.frontend.metrics
        if delta.token_ids:
            if self._last is None:
                metrics.ttft.observe(now - self._start)
            else:
                metrics.itl.observe((now - self._last) / len(delta.token_ids))
            self._last = now
        text = self.detokenizer.push(delta.token_ids)
        if delta.finish_reason is not None:
            text += self.detokenizer.finish()
            self.finish_reason = delta.finish_reason
            metrics.e2e.observe(now - self._start)
            metrics.finished.labels(reason=delta.finish_reason).inc()
            metrics.generation_tokens.inc(delta.num_output_tokens)
            metrics.prompt_tokens.inc(self.num_prompt_tokens)
        return Piece(delta, text)

    def close(self) -> None:
        """Aborts the request unless its final piece was read (a disconnect or cancel). Idempotent."""
        if self.finish_reason is None:
            self.finish_reason = "abort"
            self.frontend.metrics.finished.labels(reason="abort").inc()
        self.stream.close()


class Frontend:
    def __init__(self, llm: LLM, engine: EngineService, served_model: str, chat: ChatRenderer | None,
                 metrics: GatewayMetrics) -> None:
        self.llm = llm
        self.engine = engine
        self.served_model = served_model  # the one name /v1/models lists and requests must use
        self.chat = chat  # None when the model's vocabulary is not DeepSeek V4.1's
        self.metrics = metrics

    @property
    def vocab_size(self) -> int:
        return self.llm.source.config.vocab_size

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model:
            raise ApiError(errors.NOT_FOUND, f"the model {name!r} does not exist; this server serves "
                           f"{self.served_model!r}", param="model", code="model_not_found")

    def prompt_ids(self, args: GenerateArgs) -> list[int]:
        if args.chat_body is not None:
            if self.chat is None:
                raise errors.invalid("chat rendering needs DeepSeek's V4.1 vocabulary; this model has its own: "
                                     "use /v1/completions", "messages")
            try:
                return self.chat.render(args.chat_body)[0]
            except ChatError as err:
                raise errors.invalid(str(err), "messages") from err
        if args.prompt_text is not None:
            if args.prompt_text == "":
                raise errors.invalid("the prompt is empty", "prompt")
            return self.llm.encode(args.prompt_text)
        return list(args.prompt_token_ids or [])

    def start(self, args: GenerateArgs) -> Generation:
        """Checks, encodes and queues; raises ApiError with nothing queued."""
        self.check_model(args.model)
        ids = self.prompt_ids(args)
        client_id = args.client_id or f"req-{uuid.uuid4().hex}"
        try:
            stream = self.engine.submit(client_id, ids, args.params)
        except ValueError as err:
            raise errors.invalid(str(err)) from err
        except QueueFull as err:
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise ApiError(errors.QUEUE_FULL, str(err), code="queue_full", retry_after_s=err.retry_after_s) from err
        except ShuttingDown as err:
            raise ApiError(errors.UNAVAILABLE, str(err), code="shutting_down") from err
        self.metrics.started.labels(endpoint=args.endpoint).inc()
        detok = IncrementalDetokenizer(self.llm.tokenizer)
        return Generation(self, stream, detok, client_id, len(ids), args.endpoint)

    def abort(self, client_id: str) -> bool:
        return self.engine.abort(client_id)

    def model_info(self) -> dict[str, int | str]:
        cfg = self.llm.source.config
        return {"model": self.served_model, "vocab_size": cfg.vocab_size,
                "max_model_len": self.llm.config.max_model_len, "bos_token_id": cfg.bos_token_id,
                "eos_token_id": cfg.eos_token_id, "max_num_seqs": self.llm.config.max_num_seqs}

    def loads(self) -> list[dict[str, int | str]]:
        return [dict(self.engine.stats(), engine_id=self.engine.name)]
