"""Structured output from an OpenAI-shaped body: ``response_format`` (``json_object``, ``json_schema`` with
``strict``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``, ``grammar``, ``json_object``: the
form vLLM has taken since the guided_* fields were removed) and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``, as one engine ``Constraint`` (services/engine/structured/constraint.py).

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
STRUCTURED_OUTPUTS = {
    "json": "guided_json",
    "regex": "guided_regex",
    "choice": "guided_choice",
    "grammar": "guided_grammar",
}
"""vLLM's structured_outputs keys that name a constraint, and the guided_* field each one replaced."""
_BOOLEAN_OPTIONS = ("json_object", "disable_fallback", "disable_additional_properties", "disable_any_whitespace")
"""structured_outputs' flags: json_object (true: any JSON object), disable_fallback (either: xgrammar is the one
backend and never falls back), disable_additional_properties (true: the json schema is strict),
disable_any_whitespace (refused below when true)."""
_REFUSED_OPTIONS = {
    "disable_any_whitespace": (False, "the whitespace of JSON output is xgrammar's bounded default"),
    "whitespace_pattern": (None, "the whitespace of JSON output is xgrammar's bounded default"),
    "structural_tag": (None, "structural tags are not served; use json, regex, choice or grammar"),
}
"""structured_outputs keys refused by name: (the value that asks for nothing, why another is refused)."""


def constraint_of(
    body: dict[str, Any], conversation: dict[str, Any] | None = None, tool_calls: Constraint | None = None
) -> Constraint | None:
    """The body's constraint (None: unconstrained); a 400 naming the field for a malformed one. ``conversation``
    (chat): the body deepseek-recipe renders, whose ``thinking`` is switched off here when a constraint is set.
    ``tool_calls``: the tool-call grammar of a "required" or named tool_choice (`ChatOptions.constraint`)."""
    values = {name: body[name] for name in GUIDED if body.get(name) is not None}
    strict_json = False  # vLLM's json schemas allow additional properties unless asked otherwise
    if body.get("structured_outputs") is not None:
        asked_outputs, strict_json = _structured_outputs(body["structured_outputs"])
        values.update(asked_outputs)
    guided = list(values)
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
        constraint = _constraint(name, values[name] if name in values else body[name], conversation, strict_json)
        constraint.grammar()  # parsed here, so a bad one is a 400 naming the field before anything is queued
    except ValueError as err:
        raise errors.invalid(f"{name}: {err}", name) from err
    return constraint


def _structured_outputs(value: Any) -> tuple[dict[str, Any], bool]:
    """The constraints vLLM's ``structured_outputs`` object asks for, by the param that names each
    (``structured_outputs.json``, ...), and whether its json schema is strict; a 400 naming a key it refuses."""
    if not isinstance(value, dict):
        raise errors.invalid("structured_outputs must be an object", "structured_outputs")
    asked = {}
    for key, item in value.items():
        param = f"structured_outputs.{str(key)[:32]}"
        if item is None:
            continue
        if key in _BOOLEAN_OPTIONS and not isinstance(item, bool):
            raise errors.invalid(f"{param} must be a boolean, got {type(item).__name__}", param)
        if key in STRUCTURED_OUTPUTS or (key == "json_object" and item):
            asked[param] = item
        elif key in _REFUSED_OPTIONS and item != _REFUSED_OPTIONS[key][0]:
            raise errors.invalid(f"{param}: {_REFUSED_OPTIONS[key][1]}", param)
        elif key not in _BOOLEAN_OPTIONS and key not in _REFUSED_OPTIONS:
            known = ", ".join(sorted({*STRUCTURED_OUTPUTS, *_BOOLEAN_OPTIONS, *_REFUSED_OPTIONS}))
            raise errors.invalid(f"{param} is not a structured_outputs field; they are {known}", param)
    return asked, value.get("disable_additional_properties") is True


def _constraint(name: str, value: Any, conversation: dict[str, Any] | None, strict_json: bool = False) -> Constraint:
    if name == "response_format":
        return _response_format(value, conversation)
    if name == "structured_outputs.json_object":
        return Constraint("json_object")
    name = STRUCTURED_OUTPUTS.get(name.removeprefix("structured_outputs."), name)
    if name == "guided_json":
        schema = value if isinstance(value, str) else json.dumps(value)
        return Constraint("json_schema", schema, strict=strict_json)
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
