"""Structured output from an OpenAI-shaped body: ``response_format`` (``json_object``, ``json_schema`` with
``strict``) and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, as one
engine ``Constraint`` (services/engine/structured/constraint.py).

A chat body's ``response_format`` is read through deepseek-recipe's conversion
(``ConversationRequest.inference_options.output_constraint``), which applies DeepSeek's front end's rules (a
``json_object`` conversation must mention JSON; every schema node has a ``type``, ``anyOf`` or ``$ref``) and says
whether the output is free JSON or follows a schema; the schema enforced is the body's own (the recipe's strict
form drops bounds such as ``maxLength``). Constrained chat runs without thinking:
the grammar covers the whole output, and DeepSeek's front end serves these choices without it; a body that
switches thinking on explicitly gets a 400.
"""

from __future__ import annotations

import json
from typing import Any

from services.engine.structured.constraint import Constraint
from services.gateway import errors

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
BACKENDS = ("xgrammar", "auto")
"""guided_decoding_backend values served (vLLM's names): xgrammar is the one backend."""


def constraint_of(
    body: dict[str, Any], conversation: dict[str, Any] | None = None, tool_calls: Constraint | None = None
) -> Constraint | None:
    """The body's constraint (None: unconstrained); a 400 naming the field for a malformed one. ``conversation``
    (chat): the body deepseek-recipe renders, whose ``thinking`` is switched off here when a constraint is set.
    ``tool_calls``: the tool-call grammar of a "required" or named tool_choice (`ChatOptions.constraint`)."""
    guided = [name for name in GUIDED if body.get(name) is not None]
    response_format = body.get("response_format")
    if response_format is not None and not isinstance(response_format, dict):
        raise errors.invalid("response_format must be an object", "response_format")
    kind = (response_format or {}).get("type", "text")
    if kind not in ("text", "json_object", "json_schema"):
        raise errors.invalid(
            f"response_format type must be 'text', 'json_object' or 'json_schema', got {str(kind)[:32]!r}",
            "response_format",
        )
    asked = guided + (["response_format"] if kind != "text" else [])
    if tool_calls is not None and asked:
        raise errors.invalid(f"{asked[0]} cannot be combined with tool_choice 'required' or a named function", asked[0])
    if len(asked) > 1:
        raise errors.invalid(f"one structured-output field at a time; got {', '.join(asked)}", asked[1])
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in BACKENDS:
        raise errors.invalid(
            f"guided_decoding_backend {str(backend)[:32]!r} is not served; the backend is xgrammar",
            "guided_decoding_backend",
        )
    if not asked:
        return tool_calls
    name = asked[0]
    if conversation is not None:
        _without_thinking(conversation, name)
    try:
        constraint = _constraint(name, body[name], conversation)
        constraint.grammar()  # parsed here, so a bad one is a 400 naming the field before anything is queued
    except ValueError as err:
        raise errors.invalid(f"{name}: {err}", name) from err
    return constraint


def _constraint(name: str, value: Any, conversation: dict[str, Any] | None) -> Constraint:
    if name == "response_format":
        return _response_format(value, conversation)
    if name == "guided_json":
        schema = value if isinstance(value, str) else json.dumps(value)
        return Constraint("json_schema", schema, strict=False)
    if name == "guided_choice":
        if not isinstance(value, list):
            raise ValueError("a list of strings is needed")
        return Constraint("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise ValueError("a non-empty string is needed")
    return Constraint("regex" if name == "guided_regex" else "grammar", value)


def _without_thinking(conversation: dict[str, Any], field: str) -> None:
    if conversation.get("thinking", {}).get("type") == "enabled":
        raise errors.invalid(f"{field}: structured output runs without thinking; switch thinking off", field)
    conversation["thinking"] = {"type": "disabled"}


def _response_format(response_format: dict[str, Any], conversation: dict[str, Any] | None) -> Constraint:
    strict = True
    if response_format["type"] == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise ValueError("response_format json_schema must be an object with a schema object")
        strict = spec.get("strict") is not False
    if conversation is None:  # completions: the body's own form
        if response_format["type"] == "json_object":
            return Constraint("json_object")
        return Constraint("json_schema", json.dumps(response_format["json_schema"].get("schema", {})), strict=strict)
    output = _recipe_constraint(conversation, response_format)
    if output is None or not output.schema:
        return Constraint("json_object")
    # The recipe's strict form drops the bounds OpenAI's strict mode once lacked (maxLength, maxItems, ...), which
    # xgrammar enforces: the body's own schema is the one enforced, never a looser one.
    return Constraint("json_schema", json.dumps(response_format["json_schema"].get("schema", {})), strict=strict)


def _recipe_constraint(conversation: dict[str, Any], response_format: dict[str, Any]):
    """deepseek-recipe's ``OutputConstraint`` of the conversation with this response_format."""
    import deepseek_recipe

    from services.tokenizer.chat import RECIPE_MODEL, bounded

    body = dict(conversation, model=RECIPE_MODEL, response_format=response_format)
    try:
        request = deepseek_recipe.ChatCompletionRequest(json.dumps(body))
        return request.convert(deepseek_recipe.ConversionOptions()).inference_options.output_constraint
    except (deepseek_recipe.ConversionError, ValueError, TypeError) as err:
        raise ValueError(bounded(str(err))) from err
