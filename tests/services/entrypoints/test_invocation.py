"""The stop hint names a command that runs here: ``shinkai`` only where it is on PATH, else the checkout's
script through bash, by the path that reaches it from the working directory."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from services.entrypoints.invocation import SCRIPT, shinkai_command

ROOT = SCRIPT.parents[1]


def test_without_shinkai_on_path_from_the_checkout_it_is_the_script():
    assert shinkai_command(cwd=ROOT, path="/nonexistent") == "bash scripts/shinkai.sh"


def test_from_elsewhere_the_script_goes_by_its_absolute_path(tmp_path):
    command = shinkai_command(cwd=tmp_path, path="/nonexistent")
    assert command == f"bash {shlex.quote(str(SCRIPT))}"
    # and it runs from there: the CLI's own help
    done = subprocess.run([*shlex.split(command), "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "up" in done.stdout, done.stderr[-2000:]


def test_with_shinkai_on_path_it_is_shinkai(tmp_path):
    fake = tmp_path / "shinkai"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert shinkai_command(cwd=ROOT, path=str(tmp_path)) == "shinkai"


def test_through_the_script_the_callers_path_decides(monkeypatch, tmp_path):
    """scripts/shinkai.sh puts the venv's bin (with its own ``shinkai``) on PATH; the caller's shell has not."""
    venv_bin = tmp_path / "bin"
    venv_bin.mkdir()
    (venv_bin / "shinkai").write_text("#!/bin/sh\n")
    (venv_bin / "shinkai").chmod(0o755)
    monkeypatch.setenv("PATH", str(venv_bin))
    monkeypatch.setenv("SHINKAI_CALLER_PATH", "/usr/bin:/bin")
    assert shinkai_command(cwd=ROOT) == "bash scripts/shinkai.sh"


def test_up_prints_the_hint_it_means(monkeypatch, tmp_path, capsys):
    """`up`'s last line (with the stack itself stubbed out) ends with the runnable command."""
    from services.entrypoints import cli, stack

    monkeypatch.setenv("PATH", str(Path(os.__file__).parent))  # a PATH without shinkai
    monkeypatch.delenv("SHINKAI_CALLER_PATH", raising=False)
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(stack, "up", lambda config, timeout_s, api_key=None: {})
    assert cli.main(["up", "--run-dir", str(tmp_path)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.endswith(f"stop with: bash scripts/shinkai.sh down --run-dir {tmp_path}"), last
