"""A chat body's conversation options, checked as OpenAI does, in the form deepseek-recipe renders.

- Thinking: on by default (the model's default, deepseek-recipe's `ConversionOptions`), switched per request
  by DeepSeek's ``thinking: {"type": "enabled" | "disabled"}``, vLLM's ``chat_template_kwargs: {"thinking":
  bool}`` or ``reasoning_effort: "none"``. ``reasoning_effort`` must be one of OpenAI's values
  (`REASONING_EFFORTS`); the recipe maps them onto the model's effort levels.
- The ``developer`` role is OpenAI's name for instructions that take the place of system messages: it is
  rendered as a system message.
- ``tool_choice``: ``none`` and ``auto`` as the recipe renders them. ``required`` and a named function are
  enforced by the tool-call grammar (services/engine/structured/tool_calls.py): one or more calls of the given
  tools, or exactly one of the named function. DeepSeek's front end serves these choices without thinking (its
  prompt then ends with the calls block's opening): that is the default here. Thinking switched on explicitly
  is served too: the prompt is rendered as for ``auto`` (with only the named function's schema, as the recipe
  lists it for a named choice), and the grammar lets the reasoning run to ``</think>``, then forces the calls.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.engine.structured.constraint import Constraint
from services.engine.structured.tool_calls import ToolCallGrammar
from services.gateway import errors

# OpenAI's `ReasoningEffort` values (openai.types.shared.reasoning_effort of the pinned client).
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# The chat_template_kwargs keys served: the thinking switch under vLLM's name and Qwen's.
TEMPLATE_KWARGS = ("thinking", "enable_thinking")


@dataclass
class ChatOptions:
    """What the response side needs to know about a chat request beyond its conversation."""

    conversation: dict[str, Any]  # the body deepseek-recipe renders: messages, tools, tool_choice, thinking...
    include_reasoning: bool  # vLLM's include_reasoning: the reasoning is returned (as reasoning_content)
    parallel_tool_calls: bool  # more than one tool call may be returned; False keeps the first
    # tool_choice "required" or a named function: the tool-call grammar the output must follow; None otherwise.
    constraint: Constraint | None = None


def _thinking(body: dict[str, Any]) -> dict[str, str] | None:
    """DeepSeek's thinking switch from whichever form the body uses; None: the model's default."""
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise errors.invalid("chat_template_kwargs must be an object", "chat_template_kwargs")
    unknown = sorted(set(kwargs) - set(TEMPLATE_KWARGS))
    if unknown:
        raise errors.invalid(
            f"chat_template_kwargs: {unknown[0][:64]!r} is not served; the chat format takes only "
            + " / ".join(TEMPLATE_KWARGS),
            "chat_template_kwargs",
        )
    switches = [kwargs[k] for k in TEMPLATE_KWARGS if kwargs.get(k) is not None]
    if any(not isinstance(s, bool) for s in switches):
        raise errors.invalid("chat_template_kwargs.thinking must be true or false", "chat_template_kwargs")
    given = body.get("thinking")
    if given is not None:
        if not (isinstance(given, dict) and given.get("type") in ("enabled", "disabled")):
            raise errors.invalid('thinking must be {"type": "enabled"} or {"type": "disabled"}', "thinking")
        switches.append(given["type"] == "enabled")
    if len(set(switches)) > 1:
        raise errors.invalid("thinking is switched both on and off", "chat_template_kwargs")
    return {"type": "enabled" if switches[0] else "disabled"} if switches else None


# The roles a message may have (OpenAI's; developer is rendered as system).
ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(messages: Any) -> list[Any]:
    if not isinstance(messages, list) or not messages:
        raise errors.invalid("messages must be a non-empty list", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise errors.invalid(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise errors.invalid(
                f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.get('role')!r:.64}",
                f"messages[{i}].role",
            )
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m for m in messages]


def _forced_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The tools a call must be made from: all of them for "required", the named one for a function; None for
    "none" and "auto". A 400 naming tool_choice for anything else."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("none", "auto"):
        return None
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise errors.invalid("tools must be a list", "tools")
    if isinstance(choice, dict):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise errors.invalid(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        named = [t for t in tools if isinstance(t, dict) and (t.get("function") or {}).get("name") == name]
        if not named:
            raise errors.invalid(f"tool_choice names the function {name[:64]!r}, which is not in tools", "tool_choice")
        return named[:1]
    if choice == "required":
        if not tools:
            raise errors.invalid("tool_choice 'required' needs tools", "tool_choice")
        return tools
    raise errors.invalid(
        f"tool_choice must be 'none', 'auto', 'required' or a function, got {choice!r:.64}", "tool_choice"
    )


def _tool_call_constraint(
    body: dict[str, Any], conversation: dict[str, Any], forced: list[dict[str, Any]], parallel: bool
) -> Constraint:
    """The tool-call grammar of a "required" or named tool_choice; in thinking mode the conversation is rendered
    as for "auto" (the recipe refuses these choices with thinking), with only the forced tools."""
    thinking = conversation.get("thinking", {}).get("type") == "enabled"
    if not thinking:
        conversation["thinking"] = {"type": "disabled"}
    else:
        conversation["tool_choice"] = "auto"
        conversation["tools"] = forced
    grammar = ToolCallGrammar(forced, named=isinstance(body["tool_choice"], dict), thinking=thinking, parallel=parallel)
    try:
        constraint = grammar.constraint()
        constraint.grammar()  # parsed here, so a bad schema is a 400 before anything is queued
        return constraint
    except ValueError as err:
        raise errors.invalid(str(err), "tools") from err


def chat_options(body: dict[str, Any]) -> ChatOptions:
    """The request's `ChatOptions`; a 400 naming the field for anything OpenAI would refuse or we cannot serve."""
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise errors.invalid(
            f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r:.64}", "reasoning_effort"
        )
    forced = _forced_tools(body)
    conversation: dict[str, Any] = {"messages": _messages(body.get("messages"))}
    for key in ("tools", "tool_choice", "reasoning_effort"):
        if body.get(key) is not None:
            conversation[key] = body[key]
    thinking = _thinking(body)
    if thinking is not None:
        conversation["thinking"] = thinking
    include = body.get("include_reasoning", True)
    parallel = body.get("parallel_tool_calls", True)
    for name, value in (("include_reasoning", include), ("parallel_tool_calls", parallel)):
        if value is not None and not isinstance(value, bool):
            raise errors.invalid(f"{name} must be a boolean", name)
    constraint = None
    if forced is not None:
        constraint = _tool_call_constraint(body, conversation, forced, parallel is not False)
    return ChatOptions(conversation, include is not False, parallel is not False, constraint)
