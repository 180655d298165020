"""The import contract of pyproject.toml ([tool.importlinter]): it holds on this tree, and `lint-imports`
fails once one upward import or one cycle is added.

Each case copies the five packages into a temporary tree, adds one module that breaks one rule, and
runs `lint-imports` there with the repository's own configuration. The clean copy is the control: it
must pass, so a failure is the added module's doing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("services", "kernels", "model", "observability", "scheduler_rs")

# (new module's path, its source, what lint-imports must report: the import, or the cycle's package)
VIOLATIONS = {
    "model imports services": (
        "model/deepseek_v41/upward.py",
        "from services.engine.config import EngineConfig\n",
        "model.deepseek_v41.upward -> services.engine.config",
    ),
    "model imports kernels": (
        "model/deepseek_v41/upward.py",
        "import kernels.philox\n",
        "model.deepseek_v41.upward -> kernels.philox",
    ),
    "kernels import services": (
        "kernels/upward.py",
        "from services.worker.sampling.sampler import SamplingRow\n",
        "kernels.upward -> services.worker.sampling.sampler",
    ),
    "observability imports services": (
        "observability/upward.py",
        "import services.engine.config\n",
        "observability.upward -> services.engine.config",
    ),
    "the worker imports the engine": (
        "services/worker/upward.py",
        "from services.engine.config import EngineConfig\n",
        "services.worker.upward -> services.engine.config",
    ),
    "the engine imports the gateway": (
        "services/engine/upward.py",
        "from services.gateway.server import Server\n",
        "services.engine.upward -> services.gateway.server",
    ),
    "a cycle in services.bench": (
        "services/bench/cycle.py",
        "import services.bench.kernels.run\n",
        "No cycles are allowed in services.bench",
    ),
}


def lint(tree: Path) -> subprocess.CompletedProcess[str]:
    command = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", command, str(ROOT / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        env={"PYTHONPATH": str(tree), "PATH": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )


def copy_tree(dest: Path) -> Path:
    for name in PACKAGES:
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    return dest


def test_the_contract_holds_on_a_copy_of_the_tree(tmp_path):
    result = lint(copy_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("case", VIOLATIONS)
def test_one_violating_import_breaks_the_contract(tmp_path, case):
    path, source, named = VIOLATIONS[case]
    tree = copy_tree(tmp_path)
    (tree / path).write_text(source)
    if case == "a cycle in services.bench":  # the other half of the cycle
        kernels = tree / "services/bench/kernels/run.py"
        kernels.write_text(kernels.read_text() + "\nimport services.bench.cycle  # noqa: E402\n")
    result = lint(tree)
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout and named in result.stdout, result.stdout
