"""What a request's output must match (a JSON schema, any JSON object, a regex, one of some strings, an EBNF
grammar, or an xgrammar structural tag such as the tool-call grammar), checked and turned into an xgrammar
``Grammar`` before anything is queued.

``Constraint.grammar()`` parses: that is fast and raises ``ValueError`` naming the problem (an invalid schema,
regex or grammar, or a schema keyword xgrammar cannot enforce). Compiling the grammar against the vocabulary
(its token-mask cache, the slow part) happens off the step thread (services/engine/structured/grammars.py).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "structural_tag")

MAX_WHITESPACE = 2
"""JSON output allows whitespace between tokens, at most this many characters in a row (xgrammar's
``max_whitespace_cnt``): a model that likes spaces still has to reach the end."""

UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "dependentSchemas",
    "dependentRequired",
    "dependencies",
    "uniqueItems",
    "contains",
    "unevaluatedProperties",
    "unevaluatedItems",
    "$dynamicRef",
    "propertyNames",
)
"""JSON Schema keywords xgrammar's converter does not enforce: a schema using one is refused, never served
unconstrained in that part."""

_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\] \S+:\d+: (Check failed: \(error\.empty\(\)\) is false: )?")


@dataclass(frozen=True)
class Constraint:
    # One of KINDS.
    kind: str
    # json_schema: the schema as JSON text; regex: the pattern; grammar: EBNF (root rule ``root``); choice: a
    # JSON array of the allowed strings; structural_tag: an xgrammar structural tag as JSON (the tool-call grammar,
    # services/engine/structured/tool_calls.py); json_object: "".
    spec: str = ""
    # json_schema: no properties beyond those named (OpenAI's ``strict``, xgrammar's ``strict_mode``).
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def key(self) -> str:
        """The grammar cache's key: the same text compiles once."""
        return f"{self.kind}\x00{int(self.strict)}\x00{self.spec}"

    def grammar(self):
        """The xgrammar ``Grammar``; ValueError naming what is wrong or unsupported."""
        import xgrammar as xgr

        try:
            if self.kind == "json_object":  # an object (OpenAI's JSON mode), not any JSON value
                return xgr.Grammar.from_json_schema(
                    '{"type": "object"}', any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=False
                )
            if self.kind == "json_schema":
                check_schema(self.spec)
                return xgr.Grammar.from_json_schema(
                    self.spec, any_whitespace=True, max_whitespace_cnt=MAX_WHITESPACE, strict_mode=self.strict
                )
            if self.kind == "regex":
                return xgr.Grammar.from_regex(self.spec)
            if self.kind == "grammar":
                return xgr.Grammar.from_ebnf(self.spec)
            if self.kind == "structural_tag":
                return xgr.Grammar.from_structural_tag(self.spec)
            return xgr.Grammar.from_ebnf(choice_ebnf(self.spec))
        except RuntimeError as e:
            raise ValueError(f"{self.kind}: {_XGRAMMAR_PREFIX.sub('', str(e).strip())}") from None


def warm() -> None:
    """Compiles a trivial schema: what a process's first constraint pays once (xgrammar's import, which loads torch,
    jsonschema's, and their first use: about 1-2 s on a CPU core), for a server to pay before it serves."""
    Constraint("json_schema", '{"type": "object"}').grammar()


def choice_ebnf(spec: str) -> str:
    """``root ::= "a" | "b" ...`` for a JSON array of strings."""
    choices = json.loads(spec)
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("choice: a non-empty list of non-empty strings is needed")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_schema(spec: str) -> None:
    """ValueError unless ``spec`` is a valid JSON Schema whose every keyword xgrammar enforces."""
    import jsonschema

    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema: not JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("json_schema: a schema is an object (or a boolean)")
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        raise ValueError(f"json_schema: invalid schema at '/{where}': {e.message}") from None
    found = _unsupported(schema, "")
    if found is not None:
        raise ValueError(f"json_schema: the keyword {found[0]!r} (at '{found[1] or '/'}') cannot be enforced")


def _unsupported(node, path: str) -> tuple[str, str] | None:
    """The first keyword of UNSUPPORTED_KEYWORDS in a schema (and where), or an external ``$ref``."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            found = _unsupported(item, f"{path}/{i}")
            if found is not None:
                return found
        return None
    if not isinstance(node, dict):
        return None
    for keyword in UNSUPPORTED_KEYWORDS:
        if keyword in node:
            return keyword, path
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return "$ref to another document", path
    for name, value in node.items():
        if name in ("enum", "const", "default", "examples"):  # values, not schemas
            continue
        if name in ("properties", "$defs", "definitions", "patternProperties") and isinstance(value, dict):
            for key, sub in value.items():
                found = _unsupported(sub, f"{path}/{name}/{key}")
                if found is not None:
                    return found
        elif isinstance(value, (dict, list)):
            found = _unsupported(value, f"{path}/{name}")
            if found is not None:
                return found
    return None
