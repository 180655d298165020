"""Every constraint of the kept set (tests/services/engine/structured/data/) makes the random `tiny` model's output
valid: at temperature 1, each constrained output ends with finish reason "stop" and validates (``jsonschema``
with its format checker, ``re.fullmatch``, or the grammar's language); the same prompts unconstrained do not.

All of it is one ``LLM.generate`` call (one batch), so the suite costs one run of the longest output."""

from __future__ import annotations

import json
import pathlib
import re

import jsonschema
import pytest

from services.engine import LLM
from services.engine.finish_reason import FinishReason
from services.engine.sampling_params import SamplingParams
from services.engine.structured.constraint import Constraint

pytestmark = pytest.mark.timeout(600)

DATA = pathlib.Path(__file__).parent / "data"
SCHEMAS = json.loads((DATA / "schemas.json").read_text())
PATTERNS = json.loads((DATA / "patterns.json").read_text())
CASES = (
    [("schema", s["name"], Constraint("json_schema", json.dumps(s["schema"]))) for s in SCHEMAS]
    + [("regex", r, Constraint("regex", r)) for r in PATTERNS["regexes"]]
    + [("grammar", g["ebnf"].split("\n")[0], Constraint("grammar", g["ebnf"])) for g in PATTERNS["grammars"]]
)
MAX_TOKENS = 128  # every constrained output of the set ends well before (the longest takes under 100)
UNCONSTRAINED_TOKENS = 16
PROMPT = "Answer:"


def _valid(index: int, text: str) -> bool:
    kind = CASES[index][0]
    if kind == "schema":
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        validator = jsonschema.Draft202012Validator(
            SCHEMAS[index]["schema"], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
        return validator.is_valid(value)
    if kind == "regex":
        return re.fullmatch(PATTERNS["regexes"][index - len(SCHEMAS)], text) is not None
    grammar = PATTERNS["grammars"][index - len(SCHEMAS) - len(PATTERNS["regexes"])]
    return re.fullmatch(grammar["same_language"], text) is not None


@pytest.fixture(scope="module")
def outputs():
    """(constrained outputs, unconstrained outputs), both from one batch."""
    llm = LLM("tiny", max_num_seqs=2 * len(CASES))
    constrained = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=MAX_TOKENS, constraint=c)
        for i, (_, _, c) in enumerate(CASES)
    ]
    plain = [SamplingParams(temperature=1.0, seed=i, max_tokens=UNCONSTRAINED_TOKENS) for i in range(len(CASES))]
    outs = llm.generate([PROMPT] * (2 * len(CASES)), constrained + plain)
    stats = llm.stats()
    assert stats.free_blocks == stats.total_blocks and stats.free_state_slots == stats.total_state_slots
    return outs[: len(CASES)], outs[len(CASES) :]


def test_the_kept_set_is_as_large_as_promised():
    kinds = [kind for kind, _, _ in CASES]
    assert kinds.count("schema") >= 50 and kinds.count("regex") >= 20 and kinds.count("grammar") >= 10


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{k}-{n}" for k, n, _ in CASES])
def test_constrained_output_stops_and_validates(outputs, index):
    out = outputs[0][index]
    assert out.finish_reason == FinishReason.STOP, (out.finish_reason, out.text, out.error)
    assert _valid(index, out.text), out.text


def test_unconstrained_outputs_of_the_same_prompts_do_not_validate(outputs):
    valid = [CASES[i][1] for i, out in enumerate(outputs[1]) if _valid(i, out.text)]
    assert valid == []
