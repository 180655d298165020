"""Request building and response reading shared by the sync and asyncio clients."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from services.proto.shinkai.v1 import shinkai_pb2 as pb

FINISH_REASONS = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_PREEMPTED: "preempted",
    pb.FINISH_REASON_ERROR: "error",
}


@dataclass
class TextDelta:
    """One streamed step of a generation."""

    request_id: str  # the request's unique id, as the server made it
    client_request_id: str  # the id Abort takes
    text: str  # new text; never splits a UTF-8 character
    token_ids: list[int]  # new tokens
    finish_reason: str | None = None  # set on the last delta: "stop", "length", "abort", "preempted", "error"


@dataclass
class Completion:
    """A whole generation."""

    request_id: str  # the request's unique id, as the server made it ("" until its first response)
    client_request_id: str  # the id Abort takes
    text: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


def generate_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, Any]] | None = None,
    thinking: bool = False,
    model: str = "",
    client_request_id: str | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    logprobs: int | None = None,
    priority: int = 0,
) -> pb.GenerateRequest:
    """Exactly one of ``prompt`` (text or token ids) and ``messages`` (chat). Without a ``client_request_id``
    one is made here, so the caller can abort before the first response. ``priority``: lower is served first."""
    if (prompt is None) == (messages is None):
        raise ValueError("give exactly one of prompt and messages")
    request = pb.GenerateRequest(
        model=model, client_request_id=client_request_id or f"req-{uuid.uuid4().hex}", priority=priority
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif prompt is not None:
        request.token_ids.ids.extend(prompt)
    else:
        request.chat.thinking = thinking
        for m in messages or ():
            if isinstance(m["content"], str):
                request.chat.messages.add(role=m["role"], content=m["content"])
            else:  # OpenAI content parts: text and image_url
                message = request.chat.messages.add(role=m["role"])
                for part in m["content"]:
                    if part["type"] == "image_url":
                        message.parts.add(image_url=part["image_url"]["url"])
                    else:
                        message.parts.add(text=part["text"])
    s = request.sampling
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
        ("logprobs", logprobs),
    ):
        if value is not None:
            setattr(s, name, value)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    return request


def to_delta(response: pb.GenerateResponse) -> TextDelta:
    if response.WhichOneof("kind") == "final":
        return TextDelta(
            response.request_id,
            response.client_request_id,
            response.final.text,
            [],
            FINISH_REASONS.get(response.final.finish_reason, "error"),
        )
    return TextDelta(
        response.request_id, response.client_request_id, response.chunk.text, list(response.chunk.token_ids)
    )


def add_to(completion: Completion, response: pb.GenerateResponse) -> None:
    completion.request_id = response.request_id
    completion.client_request_id = response.client_request_id
    if response.WhichOneof("kind") == "final":
        f = response.final
        completion.text += f.text
        completion.finish_reason = FINISH_REASONS.get(f.finish_reason, "error")
        completion.prompt_tokens = f.usage.prompt_tokens
        completion.completion_tokens = f.usage.completion_tokens
    else:
        completion.text += response.chunk.text
        completion.token_ids.extend(response.chunk.token_ids)
