"""shinkai.v1 chat requests as OpenAI chat options, and chat chunks back as `ChatDelta`s.

A ``ChatMessages`` prompt becomes the same OpenAI chat body the HTTP API takes (so the same checks apply:
the developer role, reasoning_effort in OpenAI's set, tool_choice), and its answer goes through the same
deepseek-recipe parser (`ChatStream`); each piece's chunks are merged into one `ChatDelta`.
"""

from __future__ import annotations

from typing import Any

from services.gateway import errors
from services.gateway.errors import ApiError
from services.gateway.openai.chat_options import ChatOptions, chat_options
from services.gateway.openai.json_body import MAX_DEPTH, check_tree, parse_json
from services.proto.shinkai.v1 import shinkai_pb2 as pb


def content_bytes(message: pb.ChatMessage) -> int:
    """Bytes of a message's text and image URLs."""
    return len(message.content.encode()) + sum(
        len(getattr(part, part.WhichOneof("kind") or "text").encode()) for part in message.parts
    )


def message_content(i: int, message: pb.ChatMessage) -> str | list[dict]:
    """A message's OpenAI content: its text, or its parts as OpenAI content parts."""
    if not message.parts:
        return message.content
    if message.content:
        raise errors.invalid(f"chat.messages[{i}] sets both content and parts; set one", "chat.messages")
    parts: list[dict] = []
    for j, part in enumerate(message.parts):
        kind = part.WhichOneof("kind")
        if kind == "text":
            parts.append({"type": "text", "text": part.text})
        elif kind == "image_url":
            parts.append({"type": "image_url", "image_url": {"url": part.image_url}})
        else:
            raise errors.invalid(f"chat.messages[{i}].parts[{j}] is empty: set text or image_url", "chat.messages")
    return parts


def _message(i: int, message: pb.ChatMessage, content: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.reasoning_content:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in message.tool_calls
        ]
    if message.tool_call_id:
        out["tool_call_id"] = message.tool_call_id
    return out


def _tool(i: int, tool: pb.Tool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.description:
        function["description"] = tool.description
    if tool.parameters_json:
        field = f"chat.tools[{i}].parameters_json"
        try:
            function["parameters"] = parse_json(tool.parameters_json)
            check_tree(function["parameters"])  # HTTP's limits on a body: depth, finite numbers
        except ValueError as err:
            raise errors.invalid(f"{field} is not JSON: {err}", "chat.tools") from err
        except RecursionError as err:
            raise errors.invalid(f"{field} is nested deeper than {MAX_DEPTH} levels", "chat.tools") from err
        except ApiError as err:
            raise errors.invalid(f"{field}: {err.message}", "chat.tools") from err
    return {"type": "function", "function": function}


def chat_request(chat: pb.ChatMessages, contents: list[Any]) -> ChatOptions:
    """The chat's options; ``contents`` holds each message's OpenAI content (text or parts)."""
    body: dict[str, Any] = {"messages": [_message(i, m, c) for i, (m, c) in enumerate(zip(chat.messages, contents))]}
    if chat.HasField("thinking"):
        body["thinking"] = {"type": "enabled" if chat.thinking else "disabled"}
    if chat.tools:
        body["tools"] = [_tool(i, t) for i, t in enumerate(chat.tools)]
    if chat.tool_choice in ("auto", "none", "required"):
        body["tool_choice"] = chat.tool_choice
    elif chat.tool_choice:  # a function's name: that function is called
        body["tool_choice"] = {"type": "function", "function": {"name": chat.tool_choice}}
    if chat.reasoning_effort:
        body["reasoning_effort"] = chat.reasoning_effort
    try:
        return chat_options(body)
    except errors.ApiError as err:
        raise errors.invalid(err.message, f"chat.{err.param}" if err.param else "chat") from err


def chat_delta(chunks: list[dict[str, Any]]) -> tuple[pb.ChatDelta, bool]:
    """The chunks' deltas merged into one `ChatDelta`, and whether one finished with tool calls."""
    delta = pb.ChatDelta()
    called = False
    for chunk in chunks:
        for choice in chunk["choices"]:
            d = choice.get("delta") or {}
            delta.reasoning_content += d.get("reasoning_content") or ""
            delta.content += d.get("content") or ""
            for call in d.get("tool_calls") or []:
                function = call.get("function") or {}
                delta.tool_calls.add(
                    id=call.get("id") or "",
                    name=function.get("name") or "",
                    arguments=function.get("arguments") or "",
                    index=call.get("index", 0),
                )
            called = called or choice.get("finish_reason") == "tool_calls"
    return delta, called
