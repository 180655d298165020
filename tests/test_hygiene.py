"""House rules for the tracked tree: comments and docs state the project, never how or when it was built.

Rules, each a function of (path, text) or (path) that returns violations:

- ``work_periods``: no numbered work period or issue in code or docs ("session 12", "work period 3",
  "issue 8", "issue #21").
- ``file_name``: no numbered work period, issue or date in a tracked path (``gpu_session13.sh``,
  ``step-s16-sizes.json``, ``issue-8.md``, ``serve-2026-12-01.json``, ``run-20261201.log``).
- ``docstring_figures``: no hardware figure in a Python docstring: a sentence that names a GPU (H100, H200,
  A100, B200, GB200, ...) and gives a time, bandwidth, throughput, percentage or speedup ("1.9 ms on the
  H200"). Figures belong in docs/performance.md; a docstring states the design and may point there.
- ``docs_json``: no JSON file at the root of ``docs/``; results live in ``docs/results/``.

Code is ``*.py``, ``*.pyi``, ``*.rs``, ``*.proto``, ``*.sh``, ``*.toml``, ``*.yaml``/``*.yml``; docs are
``*.md``. Generated protobuf modules, ``Cargo.lock``, ``.git-blame-ignore-revs`` and this file are exempt.
"""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TEXT_SUFFIXES = {".py", ".pyi", ".rs", ".proto", ".sh", ".toml", ".yaml", ".yml", ".md"}
EXEMPT = re.compile(r"(^|/)(Cargo\.lock|\.git-blame-ignore-revs|test_hygiene\.py|[^/]*_pb2(_grpc)?\.pyi?)$")

WORK_PERIOD = re.compile(r"(?<![a-z])(?:work[\s_]+period|session|issue)s?[\s_#-]*\d+", re.IGNORECASE)
NAME_PERIOD = re.compile(r"(session|issue|period)[-_]?\d+|(^|[-_.])s\d\d+([-_.]|$)", re.IGNORECASE)
NAME_DATE = re.compile(r"(?<!\d)(19|20)\d\d(-?)(0[1-9]|1[0-2])\2(0[1-9]|[12]\d|3[01])(?!\d)")
GPU = re.compile(r"\b(?:[HAB]\d00|GB[23]00|H20|H800|A800|L40S?|MI3\d\dX?)\b")
FIGURE = re.compile(
    r"\d(?:[\d,.]*\d)?\s?(?:ms|µs|us|ns|s|[GT]B/s|TFLOP/?s|TFLOPS|%)(?![\w/])"  # a time, rate or share
    r"|\d(?:[\d,.]*\d)?\s?[x×](?!\w|\s*\d)"  # a speedup ("1.9×", "2x"), not a shape ("1,024 × 512")
)
SENTENCE_END = re.compile(r"[.!?]\s+(?=[A-Z(`\"'])|;\s|\n\s*\n")


def work_periods(path: str, text: str) -> list[str]:
    """Mentions of a numbered work period or issue, as ``path:line: match``."""
    return [f"{path}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}" for m in WORK_PERIOD.finditer(text)]


def file_name(path: str) -> list[str]:
    """The path itself, if it carries a numbered work period, issue or date."""
    if NAME_DATE.search(path) or NAME_PERIOD.search(path.rsplit("/", 1)[-1]):
        return [f"{path}: dated or numbered file name"]
    return []


def _docstrings(text: str) -> list[tuple[int, str]]:
    """(first line, text) of the module's, every class's and every function's docstring."""
    tree = ast.parse(text)
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    found = []
    for node in nodes:
        body = getattr(node, "body", [])
        if (
            body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            found.append((body[0].lineno, body[0].value.value))
    return found


def docstring_figures(path: str, text: str) -> list[str]:
    """Sentences of a Python docstring that name a GPU and give a figure, as ``path:line: sentence``."""
    if not path.endswith(".py"):
        return []
    try:
        docs = _docstrings(text)
    except SyntaxError:
        return []
    found = []
    for first, doc in docs:
        start = 0
        for end in [m.end() for m in SENTENCE_END.finditer(doc)] + [len(doc)]:
            sentence = doc[start:end]
            gpu = GPU.search(sentence)
            if gpu and FIGURE.search(sentence):
                line = first + doc.count("\n", 0, start + gpu.start())
                found.append(f"{path}:{line}: {' '.join(sentence.split())[:160]!r}")
            start = end
    return found


def docs_json(path: str) -> list[str]:
    """A JSON file at the root of docs/."""
    return (
        [f"{path}: JSON at the root of docs/ (results go in docs/results/)"]
        if re.fullmatch(r"docs/[^/]+\.json", path)
        else []
    )


def violations(path: str, text: str | None) -> list[str]:
    """Every rule on one tracked file (text None: a file not read, whose name alone is checked)."""
    if EXEMPT.search(path):
        return []
    found = file_name(path) + docs_json(path)
    if text is not None:
        found += work_periods(path, text) + docstring_figures(path, text)
    return found


# ------------------------------------------------------------------------------- each rule can fail


@pytest.mark.parametrize(
    "text",
    [
        "# measured in session 13",
        "see issue #21",
        "Issue 8's targets",
        "(work period 4)",
        "sessions 10-12",
        "def test_meets_issue_8():",
    ],
)
def test_work_periods_flagged(text: str) -> None:
    assert work_periods("a.py", "x = 1\n" + text) == [f"a.py:2: {WORK_PERIOD.search(text).group(0)!r}"]


@pytest.mark.parametrize("text", ["a session token", "the issue of scales", "s13, w13 = weights", "v41-s1"])
def test_work_periods_clean(text: str) -> None:
    assert work_periods("a.py", text) == []


@pytest.mark.parametrize(
    "path",
    [
        "scripts/gpu_session13.sh",
        "docs/step-h200-s16-sizes.json",
        "docs/issue-8.md",
        "docs/results/serve-2026-12-01.json",
        "logs/run-20261201.txt",
        "tests/test_s12.py",
    ],
)
def test_file_name_flagged(path: str) -> None:
    assert file_name(path) == [f"{path}: dated or numbered file name"]


@pytest.mark.parametrize(
    "path",
    [
        "model/presets.py",
        "docs/results/step-v41-sizes.json",
        "kernels/fp8_splitk.py",
        "tests/kernels/test_moe_splitk.py",
        "docs/eplb-simulation.png",
        "data/v41-s1.json",
        "kernels/sm90.py",
    ],
)
def test_file_name_clean(path: str) -> None:
    assert file_name(path) == []


FIGURES = '''"""The head.

An FFMA GEMM took 6.8 ms at batch 256 on the H200. Its design stands."""


class A:
    """cuBLASLt wins above 4,096 tokens on the H200
    (748 µs against 1,037)."""

    def f(self):
        """Streams at 3.1 TB/s (H100)."""

    async def g(self):
        """61% of the floor on a B200; 1.9x faster on GB200."""
'''


def test_docstring_figures_flagged() -> None:
    found = docstring_figures("k.py", FIGURES)
    assert [v.split(":")[1] for v in found] == ["3", "7", "11", "14", "14"]


@pytest.mark.parametrize(
    "doc",
    [
        "Measured in docs/performance.md, 'Kernels'; the H200 is the target.",  # a GPU, no figure
        "Takes 2 ms a step at batch 64.",  # a figure, no GPU
        "Needs an H200 for the timing. Each row reads 1.2 ms worth of weights.",  # apart, in two sentences
        "On the H200 the tile is 1,024 × 512 and 2 splits; wq_a at T = 1.",  # shapes and counts are no figures
    ],
)
def test_docstring_figures_clean(doc: str) -> None:
    assert docstring_figures("k.py", f'def f():\n    """{doc}"""\n') == []
    assert docstring_figures("k.md", f'"""{doc} 3 ms on the H200."""') == []  # only Python docstrings


def test_docs_json() -> None:
    assert docs_json("docs/step.json") and not docs_json("docs/results/step.json") and not docs_json("a.json")


def test_exempt() -> None:
    assert violations("services/proto/a/v1/a_pb2.py", "# issue 3") == []
    assert violations("tests/test_hygiene.py", "# session 1") == []
    assert violations("kernels/a.py", "# issue 3") == ["kernels/a.py:1: 'issue 3'"]


# ------------------------------------------------------------------------------- the tracked tree


def _tracked() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [p for p in out.decode().split("\0") if p]


def test_tracked_tree() -> None:
    found = []
    for path in _tracked():
        file = ROOT / path
        text = None
        if file.suffix in TEXT_SUFFIXES and file.is_file():
            text = file.read_text(encoding="utf-8", errors="replace")
        found += violations(path, text)
    assert not found, f"{len(found)} house-rule violations:\n" + "\n".join(found)
