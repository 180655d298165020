"""The grammar of DeepSeek-V4.1's tool calls (its DSML markup), for ``tool_choice: "required"`` and a named
function: the model must write a calls block of valid calls, then end.

The block, as the model writes it and deepseek-recipe's response side parses it::

    </think>

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

A string parameter is raw text (``string="true"``), any other value JSON (``string="false"``), each checked
against the function's parameter schema by xgrammar's ``deepseek_v4_1_xml`` style of its JSON-schema format;
parameters come in the schema's order, required ones always. The grammar is an xgrammar structural tag built
from its formats (a tag per function, at least one, or exactly one for a named function), as JSON text: the
spec of a ``structural_tag`` `Constraint`.

Without thinking, deepseek-recipe ends the prompt with ``</think>`` and the calls block's opening line (its
``starts_in_tool_calls``), so the grammar starts at the first ``invoke``. With thinking the prompt ends with
``<think>``: the grammar starts with free reasoning (no ``<think>`` or ``</think>`` inside), then ``</think>``
and the block's opening, which the model then writes itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.engine.structured.constraint import MAX_WHITESPACE, Constraint, check_schema

THINK_END = "</think>"
CALLS_OPEN = "\n\n<｜DSML｜ calls>\n"  # after </think>: what deepseek-recipe's prompt ends with for these choices
CALLS_CLOSE = "</｜DSML｜ calls>"
INVOKE_OPEN = '<｜DSML｜ invoke name="{name}">\n'
INVOKE_CLOSE = "</｜DSML｜ invoke>\n"
XML_STYLE = "deepseek_v4_1_xml"  # xgrammar's name for V4.1's parameter markup
NO_PARAMETERS = {"type": "object", "properties": {}}  # OpenAI: a function without parameters takes none


@dataclass(frozen=True)
class ToolCallGrammar:
    # The functions the calls may name, OpenAI's {"type": "function", "function": {"name", "parameters"}}.
    tools: list[dict[str, Any]]
    # A named tool_choice: exactly one call (of the one function in tools); otherwise one or more calls.
    named: bool
    # The prompt ends with <think>: reasoning first, then </think> and the calls block's opening line.
    thinking: bool
    # More than one call may be written (OpenAI's parallel_tool_calls); False: exactly one.
    parallel: bool = True

    def constraint(self) -> Constraint:
        """The ``structural_tag`` constraint; ValueError naming a function whose parameters cannot be enforced."""
        from xgrammar.structural_tag import (
            AnyTextFormat,
            ConstStringFormat,
            SequenceFormat,
            StructuralTag,
            TagFormat,
            TagsWithSeparatorFormat,
        )

        if not self.tools:
            raise ValueError("tool calls need at least one tool")
        tags = [self._invoke(i, tool) for i, tool in enumerate(self.tools)]
        single = self.named or not self.parallel
        elements: list[Any] = []
        if self.thinking:
            reasoning = AnyTextFormat(excludes=["<think>", THINK_END])
            elements += [TagFormat(begin="", content=reasoning, end=THINK_END), ConstStringFormat(value=CALLS_OPEN)]
        elements.append(TagsWithSeparatorFormat(tags=tags, separator="", at_least_one=True, stop_after_first=single))
        elements.append(ConstStringFormat(value=CALLS_CLOSE))
        tag = StructuralTag(format=SequenceFormat(elements=elements))
        return Constraint("structural_tag", tag.model_dump_json())

    @staticmethod
    def _invoke(i: int, tool: dict[str, Any]):
        """One function's tag: its invoke line, its parameters in V4.1's markup, the invoke's close."""
        from xgrammar.structural_tag import JSONSchemaFormat, TagFormat

        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}] needs a function with a name")
        if '"' in name or "\n" in name:
            raise ValueError(f"tools[{i}]: the function name {name[:64]!r} cannot be written in a DSML invoke")
        parameters = function.get("parameters")
        if parameters is None:
            parameters = NO_PARAMETERS
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise ValueError(f"tools[{i}] ({name[:64]}): parameters must be a JSON Schema of type object")
        try:
            check_schema(json.dumps(parameters))
        except ValueError as err:
            raise ValueError(f"tools[{i}] ({name[:64]}) parameters: {err}") from None
        content = JSONSchemaFormat(json_schema=parameters, style=XML_STYLE, max_whitespace_cnt=MAX_WHITESPACE)
        return TagFormat(begin=INVOKE_OPEN.format(name=name), content=content, end=INVOKE_CLOSE)
