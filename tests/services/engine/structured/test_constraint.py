"""A constraint parses into an xgrammar grammar, or raises ValueError naming what is wrong or unsupported."""

from __future__ import annotations

import json

import pytest

from services.engine.structured.constraint import Constraint


@pytest.mark.parametrize(
    "kind,spec",
    [
        ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
        ("json_object", ""),
        ("regex", r"\d{1,3}-[a-z]+"),
        ("grammar", 'root ::= "a" | "b" rest\nrest ::= [0-9]{1,2}'),
        ("choice", json.dumps(["yes", "no", 'say "hi"'])),
    ],
)
def test_valid_constraints_parse(kind, spec):
    assert Constraint(kind, spec).grammar() is not None


@pytest.mark.parametrize(
    "kind,spec,named",
    [
        ("json_schema", "{not json", "not JSON"),
        ("json_schema", json.dumps({"type": "strin"}), "invalid schema at '/type'"),
        ("json_schema", json.dumps({"type": "integer", "minimum": "zero"}), "invalid schema at '/minimum'"),
        ("json_schema", json.dumps([1]), "a schema is an object"),
        ("json_schema", json.dumps({"not": {"type": "string"}}), "'not'"),
        ("json_schema", json.dumps({"properties": {"a": {"if": {}, "then": {}}}}), "'if' (at '/properties/a')"),
        ("json_schema", json.dumps({"type": "array", "uniqueItems": True}), "'uniqueItems'"),
        ("json_schema", json.dumps({"$ref": "https://example.com/s.json"}), "$ref to another document"),
        ("regex", "[a-", "regex"),
        ("regex", "(ab", "regex"),
        ("grammar", 'root ::= "a" | b', "b"),
        ("grammar", "root ::= ", "grammar"),
        ("choice", json.dumps([]), "non-empty list"),
        ("choice", json.dumps(["a", 3]), "non-empty list"),
    ],
)
def test_bad_constraints_raise_naming_the_problem(kind, spec, named):
    with pytest.raises(ValueError) as err:
        Constraint(kind, spec).grammar()
    assert named in str(err.value)
    assert "/project/cpp" not in str(err.value)  # xgrammar's source location is stripped


def test_a_property_named_like_a_keyword_is_not_a_keyword():
    schema = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"type": "boolean"}}}
    assert Constraint("json_schema", json.dumps(schema)).grammar() is not None


def test_unknown_kinds_are_refused():
    with pytest.raises(ValueError, match="constraint kind"):
        Constraint("xml", "")


def test_warm_loads_the_grammar_compiler_a_first_constraint_would():
    """In a fresh interpreter (this one holds xgrammar already): after `warm`, a grammar imports nothing."""
    import subprocess
    import sys

    from services.entrypoints.stack import ROOT

    script = (
        "import sys; from services.engine.structured.constraint import Constraint, warm; "
        "assert 'xgrammar' not in sys.modules; warm(); before = set(sys.modules); "
        'Constraint(\'json_schema\', \'{"properties": {"a": {"type": "integer"}}}\').grammar(); '
        "print(sorted(set(sys.modules) - before))"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
