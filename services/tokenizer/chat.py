"""Chat rendering through DeepSeek's own deepseek-recipe (V4.1 encoding), thinking on or off.

Only the conversation keys of an OpenAI chat body reach the recipe (sampling fields are validated by the
gateway, once, for both endpoints). The recipe accepts only DeepSeek's API model names, so the body is
rendered as ``RECIPE_MODEL``; the served name was checked before. ``render`` returns the image URLs in
placeholder order, each image one ``IMAGE_PLACEHOLDER`` token in the ids, for the engine to expand to its
span (services/engine/images/prompt.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import deepseek_recipe

RECIPE_MODEL = "DeepSeek-V4.1-Flash"
# Keys of an OpenAI chat body that describe the conversation (everything else is sampling or transport).
CONVERSATION_KEYS = ("messages", "tools", "tool_choice", "thinking", "reasoning_effort")


# The request protocols deepseek-recipe converts to a conversation, by the name RenderChat takes.
PROTOCOLS = {
    "chat": deepseek_recipe.ChatCompletionRequest,
    "responses": deepseek_recipe.ResponsesRequest,
    "messages": deepseek_recipe.MessagesRequest,
}


class ChatError(ValueError):
    """The messages cannot be rendered; the text says why (a 400 / INVALID_ARGUMENT)."""


MAX_ECHO_CHARS = 48  # characters of one input value that a refusal quotes
MAX_ERROR_CHARS = 400  # characters of a refusal's whole text
_QUOTED = re.compile(r'(["`])([^"`]{%d,})\1' % (MAX_ECHO_CHARS + 1))


def bounded(message: str) -> str:
    """The recipe's refusal with every quoted input value cut to ``MAX_ECHO_CHARS`` and the whole text to
    ``MAX_ERROR_CHARS`` (its head and tail kept). The recipe quotes a value it cannot parse whole, and that
    value can be a data URL of megabytes (an ``image_url`` given as a bare string): the refusal must still
    fit a 400's body and a gRPC status's details, which a peer refuses past its metadata limit (8 KiB by
    default: the gateway then saw RESOURCE_EXHAUSTED, not INVALID_ARGUMENT)."""
    message = _QUOTED.sub(lambda m: f"{m[1]}{m[2][:MAX_ECHO_CHARS]}…{m[1]} ({len(m[2])} characters)", message)
    if len(message) > MAX_ERROR_CHARS:
        half = (MAX_ERROR_CHARS - 3) // 2
        message = f"{message[:half]} … {message[-half:]}"
    return message


IMAGE_PLACEHOLDER = "<｜image｜>"  # the recipe's one token per image in a rendered prompt (id 129279)


@dataclass
class RenderedChat:
    """A chat body rendered for the model."""

    token_ids: list[int]  # the prompt, each image one IMAGE_PLACEHOLDER token
    prompt: str = ""  # the prompt's text
    image_urls: list[str] = field(default_factory=list)  # data or http(s) URLs, in placeholder order


class ChatRenderer:
    def __init__(self, tokenizer_path: Path) -> None:
        self._encoding = deepseek_recipe.DeepseekV41Encoding()
        tokenizer = deepseek_recipe.Tokenizer.from_file(str(tokenizer_path))
        self._encoder = self._encoding.with_tokenizer(tokenizer)

    def render(self, body: dict[str, Any], protocol: str = "chat") -> RenderedChat:
        """Token ids, prompt text and the image URLs (data or external; the recipe refuses other forms,
        ``file:`` among them) of a request body's conversation, images in placeholder order. The body is an
        OpenAI chat body (only its `CONVERSATION_KEYS` are read), or one of the other `PROTOCOLS` (read whole)."""
        if protocol not in PROTOCOLS:
            raise ChatError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol[:32]!r}")
        request_body = {k: body[k] for k in CONVERSATION_KEYS if k in body} if protocol == "chat" else dict(body)
        request_body["model"] = RECIPE_MODEL
        try:
            request = PROTOCOLS[protocol](json.dumps(request_body))
            conversation = request.convert(deepseek_recipe.ConversionOptions()).conversation
            rendered = self._encoding.render_conversation(conversation)
        except (deepseek_recipe.ConversionError, ValueError, TypeError) as err:
            raise ChatError(bounded(f"messages: {err}")) from err
        images = [source.data_url if source.kind == "data_url" else source.url for source in rendered.image_sources]
        return RenderedChat(list(self._encoder.encode(conversation)), rendered.prompt, images)
