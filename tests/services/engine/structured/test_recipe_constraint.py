"""deepseek-recipe's output constraint kinds as engine constraints: what each accepts, with and without thinking."""

from __future__ import annotations

import json

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from services.engine.structured.recipe_constraint import recipe_constraint
from services.engine.structured.tool_calls import CALLS_CLOSE

SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
TOOLS = json.dumps([{"type": "function", "function": {"name": "f", "parameters": json.loads(SCHEMA)}}])


@pytest.mark.parametrize(
    "kind,schema,thinking,good,bad",
    [
        ("json", SCHEMA, False, '{"a": 1}', '{"b": 1}'),
        ("json", "", False, '{"b": [1]}', "[1]"),
        ("regex", "x[0-9]{2}", False, "x12", "x1"),
        ("json", SCHEMA, True, 'Let me see.</think>{"a": 1}', '{"a": 1}'),
        ("regex", "x[0-9]{2}", True, "hm</think>x12", "hm</think>y12"),
        (
            "tool_call_required",
            TOOLS,
            False,
            '<｜DSML｜ invoke name="f">\n<｜DSML｜ parameter name="a" string="false">3</｜DSML｜ parameter>\n'
            "</｜DSML｜ invoke>\n" + CALLS_CLOSE,
            CALLS_CLOSE,
        ),
    ],
)
def test_each_kind_accepts_what_it_should(kind, schema, thinking, good, bad):
    grammar = recipe_constraint(kind, schema, thinking).grammar()
    assert accepts(grammar, good) and not accepts(grammar, bad)


def test_auto_tool_calls_are_unconstrained_and_bad_ones_are_named():
    assert recipe_constraint("tool_call", TOOLS, True) is None
    with pytest.raises(ValueError, match="thinking"):
        recipe_constraint("tool_call_required", TOOLS, True)
    with pytest.raises(ValueError, match="'not'"):
        recipe_constraint("json", json.dumps({"not": {"type": "string"}}), True)
    with pytest.raises(ValueError, match="not served"):
        recipe_constraint("xml", "", False)
