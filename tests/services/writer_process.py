"""What the tests' writer processes (cache_writer.py, worker/manifest_writer.py) print: their result as JSON on their
last stdout line."""

from __future__ import annotations

import json
import subprocess


def json_result(proc: subprocess.Popen, timeout_s: float = 240) -> dict:
    """The writer's last stdout line as JSON, after it exits with 0 (else its stderr's end fails the test)."""
    out, err = proc.communicate(timeout=timeout_s)
    assert proc.returncode == 0, err[-2000:]
    return json.loads(out.strip().splitlines()[-1])
