"""deepseek-recipe's output constraint of a converted request (``inference_options.output_constraint``: a kind and
a schema) as an engine `Constraint`, for the protocols whose whole conversion is the recipe's (OpenAI Responses,
Anthropic Messages): their ``text.format`` / ``tool_choice`` are enforced, never dropped.

| recipe kind | constraint |
|---|---|
| ``json`` (schema empty) | any JSON object |
| ``json`` (a schema) | the schema |
| ``regex`` | the regex |
| ``tool_call_required`` (the schema: the tools) | the tool-call grammar: one or more calls of them |
| ``tool_call`` | none: the model chooses whether to call (``auto``) |

With thinking (the prompt ends with ``<think>``) the reasoning runs free to ``</think>`` and the constraint holds
the answer after it. The recipe converts ``tool_call_required`` only without thinking, its prompt ending with the
calls block's opening line (services/engine/structured/tool_calls.py).
"""

from __future__ import annotations

import json

from services.engine.structured.constraint import MAX_WHITESPACE, Constraint, check_schema
from services.engine.structured.tool_calls import THINK_END, ToolCallGrammar


def recipe_constraint(kind: str, schema: str | None, thinking: bool) -> Constraint | None:
    """The constraint of the recipe's ``kind`` and ``schema``; ``thinking``: the prompt ends with <think>.
    ValueError naming what cannot be enforced."""
    if kind == "tool_call":
        return None
    if kind == "tool_call_required":
        if thinking:
            raise ValueError("a required tool call with thinking is not served; switch thinking off")
        tools = json.loads(schema or "[]")
        return ToolCallGrammar(tools, named=False, thinking=False).constraint()
    if kind not in ("json", "regex"):
        raise ValueError(f"the output constraint {kind!r} is not served")
    if not thinking:
        if kind == "regex":
            return Constraint("regex", schema or "")
        return Constraint("json_schema", schema) if schema else Constraint("json_object")
    return _after_reasoning(kind, schema or "")


def _after_reasoning(kind: str, schema: str) -> Constraint:
    """Free reasoning to </think>, then the JSON (or regex) answer: an xgrammar structural tag."""
    from xgrammar.structural_tag import (
        AnyTextFormat,
        JSONSchemaFormat,
        RegexFormat,
        SequenceFormat,
        StructuralTag,
        TagFormat,
    )

    if kind == "regex":
        answer = RegexFormat(pattern=schema)
    else:
        if schema:
            check_schema(schema)
        parsed = json.loads(schema) if schema else {"type": "object"}
        answer = JSONSchemaFormat(json_schema=parsed, max_whitespace_cnt=MAX_WHITESPACE)
    reasoning = TagFormat(begin="", content=AnyTextFormat(excludes=["<think>", THINK_END]), end=THINK_END)
    return Constraint(
        "structural_tag", StructuralTag(format=SequenceFormat(elements=[reasoning, answer])).model_dump_json()
    )
