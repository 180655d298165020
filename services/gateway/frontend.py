"""What HTTP and gRPC share: model check, prompt encoding, submission to an engine, detokenized streams.

Both protocols turn their request into a `GenerateArgs`, ``await Frontend.start`` (which raises `ApiError`
before anything streams) and read `Piece`s from the returned `Generation` until the final one. The
engine and tokenizer are backends (services/gateway/backends.py): in-process for `shinkai serve`,
gRPC for the gateway of `shinkai up`.

Images: the tokenizer renders a chat's ``image_url`` parts as one placeholder each and returns their URLs;
the `ImageFetcher` turns them into bytes here (the gateway's job: it is the process facing the network), and
the engine gets ids and bytes (it plans the spans, has them encoded and holds the request behind the
readiness gate meanwhile; services/engine/images/prompt.py).
"""

from __future__ import annotations

import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from observability import tracing
from observability.metrics import RequestMetrics
from services.engine.images.prompt import ImageEncoderUnavailable
from services.engine.model_info import ModelInfo
from services.engine.sampling_params import SamplingParams
from services.engine.service import QueueFull, ShuttingDown
from services.engine.stats import EngineStats
from services.gateway import errors
from services.gateway.admission import Admission, TenantOverLimit, Ticket
from services.gateway.backends import DeltaStream, EngineBackend, TokenizerBackend
from services.gateway.choices import ChoiceStreams
from services.gateway.errors import ApiError
from services.gateway.generation import Generation
from services.gateway.image_fetcher import ImageFetcher
from services.gateway.stop_strings import StopStrings

# What a masked token's logprob (-inf: outside top-k / top-p) reads as in every response, HTTP and gRPC, as in
# vLLM: JSON has no infinities, and `JSON.parse` refuses the `-Infinity` Python would write.
MASKED_LOGPROB = -9999.0


def finite_logprob(value: float) -> float:
    return value if math.isfinite(value) else MASKED_LOGPROB


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
    # The protocol of chat_body: "chat", "responses" or "messages" (services/tokenizer/chat.py PROTOCOLS).
    chat_protocol: str = "chat"
    # Validated sampling parameters.
    params: SamplingParams = SamplingParams()
    # The client's name for the request (Abort takes it); None: the request_id.
    client_request_id: str | None = None
    # The request's unique id, when a gateway made it and forwarded the request here; None: made here.
    request_id: str | None = None
    # Which API this came through (a metrics label).
    endpoint: str = "generate"
    # The caller's trace context (W3C, from HTTP headers or gRPC metadata); None: a new trace, or tracing off.
    trace_parent: Any = None
    # The caller's API-key namespace (services/gateway/auth.py); None: authentication is off.
    owner: str | None = None
    # Encoded images for the image placeholders of prompt_token_ids, when a gateway forwarded a chat with
    # images here (takes_request_ids); empty otherwise.
    images: list[bytes] = field(default_factory=list)
    # Stop strings matched on the detokenized text (services/gateway/stop_strings.py); empty: none.
    stop: tuple[str, ...] = ()
    # A matched stop string stays in the returned text.
    include_stop_str_in_output: bool = False
    # Special tokens are left out of the text (vLLM's skip_special_tokens).
    skip_special_tokens: bool = True
    # Scheduling priority: lower is served first (docs/architecture.md, "The waiting queue's order").
    priority: int = 0
    # The caller's network address (host, no port): the tenant of an open API; None: unknown.
    client_address: str | None = None
    # Who the request is served for, when a gateway forwarded it here (takes_request_ids); None: this front end
    # names it (`tenant_of`).
    tenant: str | None = None


MAX_ID_BYTES = 256
"""The longest client_request_id, request_id or model name either API takes (UTF-8 bytes)."""


def tenant_of(args: GenerateArgs) -> str:
    """Who a request is served for (admission and the engine's fair queue): the tenant a gateway forwarded,
    else the API key's owner, else the client's address ("" when that is unknown)."""
    if args.tenant is not None:
        return args.tenant
    return args.owner or args.client_address or ""


def scoped(client_request_id: str, owner: str | None) -> str:
    """The client_request_id the engines know: the client's inside its key's namespace, when keys are on."""
    return client_request_id if owner is None else f"{owner}/{client_request_id}"


# Sampling fields whose name begins the engine's ValueError messages about them.
_PARAMS = (
    "stop_token_ids",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "logprobs",
    "n",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "min_p",
    "prompt_logprobs",
)


def _param_of(message: str, args: GenerateArgs) -> str | None:
    """The request field an engine or tokenizer refusal is about: engine messages begin with the field's
    name, or with "the prompt" / "token id" when the prompt is at fault."""
    first = message.split(" ", 1)[0]
    if first in _PARAMS:
        return first
    if first == "banned_token_ids":
        return "logit_bias"
    if message.startswith(("the prompt", "token id", "prompt")):
        return "messages" if args.chat_body is not None else "prompt"
    if _IMAGE_MESSAGE.match(message):
        return "messages"
    return None


# How the tokenizer words a prompt that is over the context's budget (services/tokenizer/budget.py).
_OVER_CONTEXT = re.compile(r"tokens the context leaves for it")

# How refusals of a request's images begin (services/multimodal/preprocess.py, image_fetch.py and
# services/engine/images/prompt.py): they are about the chat's image parts.
_IMAGE_MESSAGE = re.compile(
    r"the (\w+ )?image|image|\d+ images|this model has no vision tower|"
    r"this engine takes no images"
)


class Frontend:
    def __init__(
        self,
        info: ModelInfo,
        engine: EngineBackend,
        tokenizer: TokenizerBackend,
        metrics: RequestMetrics,
        takes_request_ids: bool = False,
        image_fetcher: ImageFetcher | None = None,
        admission: Admission | None = None,
    ) -> None:
        self.info = info
        self.engine = engine
        self.tokenizer = tokenizer
        self.metrics = metrics
        # Turns a chat's image URLs into bytes (data URLs decoded, http(s) fetched under the SSRF rule).
        self.image_fetcher = image_fetcher or ImageFetcher()
        # True behind a gateway (an engine process): a request may bring the gateway's request_id. False: this
        # front end makes every request_id, and a request that brings one is refused.
        self.takes_request_ids = takes_request_ids
        # Per-tenant limits (services/gateway/admission.py), on the user-facing front end; None: none (an engine
        # process behind a gateway, which admitted the request already).
        self.admission = admission
        metrics.model_name = info.model  # the vLLM names' label

    @property
    def served_model(self) -> str:
        return self.info.model

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served_model:
            raise ApiError(
                errors.NOT_FOUND,
                f"the model {name!r} does not exist; this server serves {self.served_model!r}",
                param="model",
                code="model_not_found",
            )

    async def prompt(self, args: GenerateArgs) -> tuple[list[int], list[str]]:
        """The prompt's ids and its chat's image URLs (one recipe placeholder each in the ids, in order).
        Text and chat are refused (400, OpenAI's ``context_length_exceeded``) as soon as their length proves
        them over the tokens the context leaves after max_tokens (one token when max_tokens is unset: the
        rest of the context): from their bytes before encoding, else after (images counted as their one
        placeholder here; the engine checks the expanded prompt)."""
        max_tokens = args.params.max_tokens
        if max_tokens is not None and max_tokens > self.info.max_model_len:
            raise errors.invalid(
                f"max_tokens must be between 1 and the context of {self.info.max_model_len} tokens, got {max_tokens}",
                "max_tokens",
            )
        budget = self.info.max_model_len - (max_tokens or 1)
        param = "messages" if args.chat_body is not None else "prompt"
        try:
            if args.chat_body is not None:
                rendered = await self.tokenizer.render_chat(args.chat_body, budget, args.chat_protocol)
                return rendered.token_ids, rendered.image_urls
            if args.prompt_text is not None:
                if args.prompt_text == "":
                    raise errors.invalid("the prompt is empty", "prompt")
                return await self.tokenizer.encode(args.prompt_text, budget), []
        except ValueError as err:  # ChatError included
            message = str(err)
            if _OVER_CONTEXT.search(message):
                raise ApiError(
                    errors.INVALID,
                    f"This model's maximum context length is {self.info.max_model_len} tokens: {message}",
                    param,
                    code="context_length_exceeded",
                ) from err
            raise errors.invalid(message, param) from err
        return list(args.prompt_token_ids or []), []

    async def start(self, args: GenerateArgs) -> Generation:
        """`start_choices` for one choice (``n`` = 1: the protocols that have no choices)."""
        if args.params.n != 1:
            raise errors.invalid(f"n > 1 (n={args.params.n}): the {args.endpoint} protocol has one answer", "n")
        return (await self.start_choices(args))[0]

    async def start_choices(self, args: GenerateArgs) -> list[Generation]:
        """Checks, encodes and queues; raises ApiError with nothing queued. One `Generation` per choice (``n``
        of them, services/gateway/choices.py). The request's span (a child of ``args.trace_parent``) is
        current while the tokenizer and the engine are called, so they join its trace; choice 0 ends it."""
        arrival = time.monotonic()
        self.check_model(args.model)
        if args.request_id is not None and not self.takes_request_ids:
            raise errors.invalid(
                "request_id is made by the server; name a request with client_request_id", "request_id"
            )
        if args.images and not self.takes_request_ids:
            raise errors.invalid("images travel as image_url parts of a chat's messages", "images")
        if args.tenant is not None and not self.takes_request_ids:
            raise errors.invalid("tenant is set by the server from the API key or the client's address", "tenant")
        tenant = tenant_of(args)
        ticket: Ticket | None = None
        stream: DeltaStream | None = None
        request_id = args.request_id or f"req-{uuid.uuid4().hex}"
        client_request_id = args.client_request_id or request_id
        span = tracing.start_span(
            "request",
            args.trace_parent,
            {
                "request.id": request_id,
                "request.client_request_id": client_request_id,
                "request.endpoint": args.endpoint,
            },
        )
        try:
            with tracing.active(span):
                with tracing.span("tokenize") if args.prompt_token_ids is None else tracing.active(None):
                    ids, urls = await self.prompt(args)
                images = args.images
                if (urls or images) and args.params.prompt_logprobs is not None:
                    raise errors.invalid("prompt_logprobs are not served for prompts with images", "prompt_logprobs")
                if urls:
                    with tracing.span("fetch_images"):
                        images = await self.image_fetcher.fetch(urls)
                if self.admission is not None:
                    ticket = self.admission.admit(tenant, len(ids), args.params.n)
                stream = await self.engine.submit(
                    request_id, scoped(client_request_id, args.owner), ids, args.params, images, args.priority, tenant
                )
                detokenize_span = (
                    tracing.start_span("detokenize") if getattr(self.tokenizer, "detokenize", True) else None
                )
                with tracing.active(detokenize_span):
                    detokenizer = self.tokenizer.detokenizer(args.skip_special_tokens)
        except ValueError as err:
            tracing.end(span, error="invalid")
            raise errors.invalid(str(err), _param_of(str(err), args)) from err
        except ImageEncoderUnavailable as err:
            tracing.end(span, error="unavailable")
            raise ApiError(errors.UNAVAILABLE, str(err), code="multimodal_unavailable") from err
        except QueueFull as err:
            tracing.end(span, error="queue_full")
            self.metrics.rejected.labels(reason="queue_full").inc()
            raise ApiError(errors.QUEUE_FULL, str(err), code="queue_full", retry_after_s=err.retry_after_s) from err
        except ShuttingDown as err:
            tracing.end(span, error="unavailable")
            raise ApiError(errors.UNAVAILABLE, str(err), code="shutting_down") from err
        except TenantOverLimit as err:
            tracing.end(span, error="tenant_limit")
            self.metrics.rejected.labels(reason="tenant_limit").inc()
            raise ApiError(
                errors.QUEUE_FULL, str(err), code="rate_limit_exceeded", retry_after_s=err.retry_after_s
            ) from err
        except BaseException:
            tracing.end(span, error="failed")
            raise
        finally:
            if ticket is not None and stream is None:  # admitted, then refused by the engine or cancelled
                ticket.cancel()
        num_prompt_tokens = stream.num_prompt_tokens  # image spans expanded: the engine's count
        if span is not None:
            span.set_attribute("request.prompt_tokens", num_prompt_tokens)
        self.metrics.started.labels(endpoint=args.endpoint).inc()
        n = args.params.n
        split = ChoiceStreams(stream, n) if n > 1 else None
        streams = [stream] if split is None else [split.choice(i) for i in range(n)]
        return [
            Generation(
                self.metrics,
                choice,
                detokenizer if i == 0 else self.tokenizer.detokenizer(args.skip_special_tokens),
                request_id,
                client_request_id,
                num_prompt_tokens,
                args.endpoint,
                arrival,
                span if i == 0 else None,
                detokenize_span if i == 0 else None,
                StopStrings(args.stop, args.include_stop_str_in_output) if args.stop else None,
                index=i,
                prompt_token_ids=ids,
                ticket=ticket,
            )
            for i, choice in enumerate(streams)
        ]

    async def abort(self, client_request_id: str, owner: str | None = None) -> bool:
        """Aborts the caller's live requests with this client_request_id; another key's are out of its reach."""
        return await self.engine.abort(scoped(client_request_id, owner))

    async def loads(self) -> dict[str, EngineStats]:
        return await self.engine.loads()
