"""What the tests' writer processes (cache_writer.py, worker/manifest_writer.py) print: their result as JSON on their
last stdout line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def module_process(env: dict[str, str], module: str, *argv: str) -> subprocess.Popen:
    """``python -m module argv…`` from the repository root with ``env``, its output piped as text."""
    return subprocess.Popen(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def json_result(proc: subprocess.Popen, timeout_s: float = 240) -> dict:
    """The writer's last stdout line as JSON, after it exits with 0 (else its stderr's end fails the test)."""
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])
