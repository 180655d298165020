"""Request building and response reading shared by the sync and asyncio clients."""

from __future__ import annotations

import json
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
class ToolCall:
    """A tool call of a chat answer; streamed, a piece of one (its index, then more of its arguments)."""

    index: int  # which call of the answer, from 0
    id: str  # the call's id (set on its first piece), which the tool result's tool_call_id names
    name: str  # the function's name (set on its first piece)
    arguments: str  # its JSON arguments as text (streamed: the next piece of that text)


@dataclass
class TextDelta:
    """One streamed step of a generation."""

    request_id: str  # the request's unique id, as the server made it
    client_request_id: str  # the id Abort takes
    text: str  # new text; never splits a UTF-8 character
    token_ids: list[int]  # new tokens
    # Set on the last delta: "stop", "length", "abort", "preempted", "error", or "tool_calls" (a chat answer
    # that ended in tool calls).
    finish_reason: str | None = None
    reasoning_content: str = ""  # chat: new reasoning (the text split by the model's format)
    content: str = ""  # chat: new answer text
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat: tool-call pieces
    index: int = 0  # which of the request's n choices this delta belongs to (0 to n - 1)
    # On a choice's first delta, with prompt_logprobs set: per prompt token after the first, its logprob
    # under the raw model; None otherwise.
    prompt_logprobs: list[float] | None = None
    logprobs: list[float] = field(default_factory=list)  # per new token, its logprob (processed distribution)
    # With logprobs set: per new token, the top (token id, logprob) pairs, best first; empty otherwise.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


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
    reasoning_content: str = ""  # chat: the reasoning
    content: str = ""  # chat: the answer
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat: the tool calls, arguments whole
    index: int = 0  # which of the request's n choices this is (0 to n - 1)
    # With prompt_logprobs set: per prompt token after the first, its logprob under the raw model, and the
    # top (token id, logprob) pairs at its position; None otherwise.
    prompt_logprobs: list[float] | None = None
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    prompt_ranks: list[int] | None = None  # per such token, how many tokens have a logprob >= its own
    logprobs: list[float] = field(default_factory=list)  # per output token, its logprob (processed distribution)
    # With logprobs set: per output token, the top (token id, logprob) pairs, best first; empty otherwise.
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens taken from the engine's prefix cache instead of computed


def generate_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[dict[str, Any]] | None = None,
    thinking: bool | None = None,
    tools: Sequence[dict[str, Any]] = (),
    tool_choice: str | None = None,
    reasoning_effort: str | None = None,
    stop: Sequence[str] = (),
    include_stop_str_in_output: bool = False,
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
    n: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    min_tokens: int | None = None,
    min_p: float | None = None,
    prompt_logprobs: int | None = None,
    skip_special_tokens: bool | None = None,
) -> pb.GenerateRequest:
    """Exactly one of ``prompt`` (text or token ids) and ``messages`` (chat, OpenAI's message dicts: with
    ``reasoning_content``, ``tool_calls`` and ``tool_call_id`` for the turns of a tool loop; ``tools`` as
    OpenAI's function tools; ``thinking`` None: the model's default). Without a ``client_request_id`` one is
    made here, so the caller can abort before the first response. ``priority``: lower is served first.
    Sampling fields left None take the server's defaults; ``n`` > 1 streams n choices (`TextDelta.index`)."""
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
        _chat(request.chat, messages or (), thinking, tools, tool_choice, reasoning_effort)
    s = request.sampling
    sampling = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "n": n,
        "logprobs": logprobs,
        "presence_penalty": presence_penalty,
        "frequency_penalty": frequency_penalty,
        "repetition_penalty": repetition_penalty,
        "min_tokens": min_tokens,
        "min_p": min_p,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": skip_special_tokens,
    }
    for name, value in sampling.items():  # unset: the server's default
        if value is not None:
            setattr(s, name, value)
    s.stop_token_ids.extend(stop_token_ids)
    s.ignore_eos = ignore_eos
    s.stop.extend(stop)
    s.include_stop_str_in_output = include_stop_str_in_output
    return request


def _chat(
    chat: pb.ChatMessages,
    messages: Sequence[dict[str, Any]],
    thinking: bool | None,
    tools: Sequence[dict[str, Any]],
    tool_choice: str | None,
    reasoning_effort: str | None,
) -> None:
    if thinking is not None:
        chat.thinking = thinking
    for m in messages:
        message = chat.messages.add(role=m["role"])
        content = m.get("content") or ""
        if isinstance(content, str):
            message.content = content
        else:  # OpenAI content parts: text and image_url
            for part in content:
                if part["type"] == "image_url":
                    message.parts.add(image_url=part["image_url"]["url"])
                else:
                    message.parts.add(text=part["text"])
        message.reasoning_content = m.get("reasoning_content") or ""
        message.tool_call_id = m.get("tool_call_id") or ""
        for call in m.get("tool_calls") or ():
            function = call["function"]
            message.tool_calls.add(id=call.get("id", ""), name=function["name"], arguments=function["arguments"])
    for tool in tools:
        function = tool["function"]
        chat.tools.add(
            name=function["name"],
            description=function.get("description") or "",
            parameters_json=json.dumps(function["parameters"]) if function.get("parameters") is not None else "",
        )
    chat.tool_choice = tool_choice or ""
    chat.reasoning_effort = reasoning_effort or ""


def _tool_calls(delta: pb.ChatDelta) -> list[ToolCall]:
    return [ToolCall(c.index, c.id, c.name, c.arguments) for c in delta.tool_calls]


def _finish_reason(final: pb.Final) -> str:
    return "tool_calls" if final.tool_calls else FINISH_REASONS.get(final.finish_reason, "error")


def to_delta(response: pb.GenerateResponse) -> TextDelta:
    if response.WhichOneof("kind") == "final":
        f = response.final
        return TextDelta(
            response.request_id,
            response.client_request_id,
            f.text,
            [],
            _finish_reason(f),
            f.chat.reasoning_content,
            f.chat.content,
            _tool_calls(f.chat),
            f.index,
        )
    c = response.chunk
    return TextDelta(
        response.request_id,
        response.client_request_id,
        c.text,
        list(c.token_ids),
        None,
        c.chat.reasoning_content,
        c.chat.content,
        _tool_calls(c.chat),
        c.index,
        list(c.prompt_logprobs) if c.prompt_logprobs else None,
        list(c.logprobs),
        _tops(c.top_logprobs),
    )


def _tops(tops: Sequence[pb.TokenTopLogprobs]) -> list[list[tuple[int, float]]]:
    return [[(e.token_id, e.logprob) for e in t.entries] for t in tops]


def _accumulate(completion: Completion, delta: pb.ChatDelta) -> None:
    completion.reasoning_content += delta.reasoning_content
    completion.content += delta.content
    for piece in delta.tool_calls:
        if piece.index == len(completion.tool_calls):
            completion.tool_calls.append(ToolCall(piece.index, piece.id, piece.name, ""))
        call = completion.tool_calls[piece.index]
        call.id, call.name = call.id or piece.id, call.name or piece.name
        call.arguments += piece.arguments


def add_to(completions: list[Completion], response: pb.GenerateResponse, client_request_id: str) -> None:
    """Adds a response to its choice's `Completion` (made on the choice's first response)."""
    kind = response.WhichOneof("kind")
    index = response.final.index if kind == "final" else response.chunk.index
    while len(completions) <= index:
        completions.append(Completion("", client_request_id, "", index=len(completions)))
    completion = completions[index]
    completion.request_id = response.request_id
    completion.client_request_id = response.client_request_id
    if kind == "final":
        f = response.final
        completion.text += f.text
        completion.finish_reason = _finish_reason(f)
        completion.prompt_tokens = f.usage.prompt_tokens
        completion.completion_tokens = f.usage.completion_tokens
        completion.cached_tokens = f.usage.cached_tokens
        _accumulate(completion, f.chat)
    else:
        c = response.chunk
        completion.text += c.text
        completion.token_ids.extend(c.token_ids)
        completion.logprobs.extend(c.logprobs)
        completion.top_logprobs.extend(_tops(c.top_logprobs))
        if c.prompt_logprobs and completion.prompt_logprobs is None:
            completion.prompt_logprobs = list(c.prompt_logprobs)
            completion.prompt_ranks = list(c.prompt_ranks)
            completion.prompt_top_logprobs = _tops(c.prompt_top_logprobs)
        _accumulate(completion, c.chat)
