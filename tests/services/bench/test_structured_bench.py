"""`shinkai bench structured` on the tiny model, small: every mode, batch and kind times full-batch decode steps with
no error finish, the mask fills and compiles are reported, and the batch-64 target reads the async typical row (the
figures are the GPU run's; this checks the harness)."""

import json

from services.bench.structured.run import TARGET_RATIO, targets
from services.entrypoints.cli import build_parser

FLAG = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
SCHEMAS = [{"name": "flag", "schema": FLAG}]
PATTERNS = {"regexes": ["[a-c]{2,5}"], "grammars": [{"ebnf": 'root ::= "yes" | "no"', "same_language": "yes|no"}]}


def test_the_structured_bench_times_every_mode_batch_and_kind(tmp_path):
    (tmp_path / "schemas.json").write_text(json.dumps(SCHEMAS))
    (tmp_path / "patterns.json").write_text(json.dumps(PATTERNS))
    out = tmp_path / "structured.json"
    args = build_parser().parse_args(
        [
            "bench", "structured", "--batches", "1,2", "--worst-batches", "1", "--steps", "2", "--rounds", "1",
            "--prompt-len", "8", "--walks", "1", "--walk-tokens", "24", "--constraint-dir", str(tmp_path),
            "--json", str(out),
        ]
    )  # fmt: skip
    assert args.func(args) == 0
    figures = json.loads(out.read_text())
    cases = {(r["async"], r["batch"], r["kind"]) for r in figures["decode"]}
    expected = {(a, b, k) for a in (False, True) for b in (1, 2) for k in ("unconstrained", "typical")}
    assert cases == expected | {(False, 1, "worst"), (True, 1, "worst")}
    for row in figures["decode"]:
        assert row["steps"] >= 1 and row["step_ms_median"] > 0 and row["errors"] == 0, row
        assert row["vs_unconstrained"] is not None
    assert set(figures["mask_fill"]) == {"typical", "worst"}
    assert all(f["n"] >= 1 and f["max_ms"] >= f["median_ms"] > 0 for f in figures["mask_fill"].values())
    assert figures["compile"]["n"] == 3 and figures["compile"]["first_compile_ms"] > 0
    assert figures["targets"] == []  # no batch-64 row in this run


def test_the_target_is_the_async_typical_row_at_batch_64():
    rows = [
        {"async": a, "batch": b, "kind": k, "vs_unconstrained": v}
        for a, b, k, v in [
            (True, 64, "typical", 1.2),
            (False, 64, "typical", 1.01),
            (True, 16, "typical", 1.5),
            (True, 64, "worst", 3.0),
        ]
    ]
    found = targets(rows)
    assert [(t.value, t.limit, t.met) for t in found] == [(1.2, TARGET_RATIO, False)]
