"""Host costs of structured output over DeepSeek-V4.1's vocabulary: grammar compiles and the per-step mask fill.

Compiles (one compile thread, a fresh `GrammarCompiler`): the first (which builds the vocabulary's tables), then
the tool-call grammar of each test tool named, and of all of them with ``tool_choice: "required"``, without and
with thinking (the tools of tests/services/gateway/openai/test_tool_choice.py). Mask fill: `fill_rows` for one
request's 1 + k rows (k drafts) at every position of a fixed answer, for a JSON schema and for a tool call whose
string parameter is raw text bounded by ``maxLength``, unbounded, or an enum. Median and max over positions.

    python3 scripts/diagnostics/structured_costs.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
    },
    "required": ["city", "unit", "temp"],
    "additionalProperties": False,
}
ANSWER = '{"city": "Paris", "unit": "celsius", "temp": 21}'
CALL = (
    '<｜DSML｜ invoke name="w">\n<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
    "</｜DSML｜ invoke>\n</｜DSML｜ calls>"
)
CITIES = {
    "maxLength 8": {"type": "string", "maxLength": 8},
    "unbounded": {"type": "string"},
    "enum": {"enum": ["Paris"]},
}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def main() -> None:
    from model.deepseek_v41.tokenizer import load_v41_tokenizer
    from services.engine.structured.constraint import Constraint
    from services.engine.structured.grammars import GrammarCompiler
    from services.engine.structured.token_masks import fill_rows
    from services.engine.structured.tool_calls import ToolCallGrammar
    from tests.services.gateway.openai.test_tool_choice import TOOLS

    tok = load_v41_tokenizer()
    grammars = GrammarCompiler(tok, tok.get_vocab_size(), 1)
    start = time.perf_counter()
    grammars.compile(Constraint("regex", "a")).result()
    print(f"first compile (the vocabulary's tables): {_ms(time.perf_counter() - start)}")
    for thinking in (False, True):
        cases = [("required, all tools", ToolCallGrammar(TOOLS, named=False, thinking=thinking))]
        cases += [
            (f"named {t['function']['name']}", ToolCallGrammar([t], named=True, thinking=thinking)) for t in TOOLS
        ]
        for name, grammar in cases:
            start = time.perf_counter()
            grammars.compile(grammar.constraint()).result()
            print(f"compile {name}, thinking {thinking}: {_ms(time.perf_counter() - start)}")

    fills = [("json schema", Constraint("json_schema", json.dumps(SCHEMA)), ANSWER)]
    for label, city in CITIES.items():
        tools = [
            {
                "type": "function",
                "function": {"name": "w", "parameters": {"type": "object", "properties": {"city": city}}},
            }
        ]
        fills.append(
            (f"tool call, city {label}", ToolCallGrammar(tools, named=True, thinking=False).constraint(), CALL)
        )
    for name, constraint, text in fills:
        compiled = grammars.compile(constraint).result()
        ids = tok.encode(text, add_special_tokens=False).ids
        for k in (0, 3):
            times = []
            for at in range(len(ids) - k):
                matcher = grammars.matcher(compiled)
                for token in ids[:at]:
                    assert matcher.accept_token(token)
                mask = grammars.bitmask(k + 1)
                start = time.perf_counter()
                fill_rows(matcher, mask, 0, ids[at : at + k])
                times.append(time.perf_counter() - start)
            print(f"fill {name}, 1 + {k} rows: median {_ms(statistics.median(times))}, max {_ms(max(times))}")


if __name__ == "__main__":
    main()
