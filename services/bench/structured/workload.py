"""What `shinkai bench structured` constrains: a typical JSON schema (what every request of a constrained decode
round follows), the worst case known for the per-step mask fill (a tool call whose string parameter is raw text
bounded by ``maxLength``), and the repository's constraint set (the compile section's)."""

from __future__ import annotations

import json
from pathlib import Path

from services.engine.structured.constraint import Constraint

TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 48},
        "email": {"type": "string", "maxLength": 48},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "editor", "viewer"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 8},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 48},
                "city": {"type": "string", "maxLength": 32},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["id", "name", "email", "active", "role", "tags", "address"],
    "additionalProperties": False,
}
"""A record a JSON-mode client asks for: integers, bounded strings, a boolean, an enum, an array, a nested object."""

WORST_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 64}},
            "required": ["query"],
        },
    },
}
"""A named tool whose one string parameter is raw text bounded by ``maxLength``: xgrammar checks the
context-dependent tokens of such a string at every fill, the slowest mask fill known."""

DATA = Path(__file__).resolve().parents[3] / "tests" / "services" / "engine" / "structured" / "data"
"""The repository's constraint set: JSON schemas, regexes and EBNF grammars (its README says what is kept)."""


def typical() -> Constraint:
    return Constraint("json_schema", json.dumps(TYPICAL_SCHEMA))


def worst() -> Constraint:
    from services.engine.structured.tool_calls import ToolCallGrammar

    return ToolCallGrammar([WORST_TOOL], named=True, thinking=False).constraint()


def constraint_set(data: Path = DATA) -> list[tuple[str, Constraint]]:
    """(name, constraint) for every schema, regex and grammar kept in ``data``."""
    schemas = json.loads((data / "schemas.json").read_text())
    patterns = json.loads((data / "patterns.json").read_text())
    return (
        [(f"schema {s['name']}", Constraint("json_schema", json.dumps(s["schema"]))) for s in schemas]
        + [(f"regex {r}", Constraint("regex", r)) for r in patterns["regexes"]]
        + [(f"grammar {g['ebnf'].splitlines()[0]}", Constraint("grammar", g["ebnf"])) for g in patterns["grammars"]]
    )
