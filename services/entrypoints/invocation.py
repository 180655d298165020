"""The command a person types to run the ``shinkai`` CLI here, for the hints the CLI prints (``… down``).

``shinkai`` where the console script is on the caller's PATH; otherwise the checkout's ``scripts/shinkai.sh``
through bash, by a path relative to the working directory when it lies below it (``bash scripts/shinkai.sh``
from the checkout's root), else by its absolute path. The caller's PATH is the one ``scripts/shinkai.sh`` saw
(``SHINKAI_CALLER_PATH``): the script activates the venv, whose bin holds a ``shinkai`` the caller's shell
does not have.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "shinkai.sh"


def shinkai_command(cwd: Path | None = None, path: str | None = None) -> str:
    """``cwd`` and ``path`` (the PATH searched) default to the process's own (the caller's PATH, above)."""
    if path is None:
        path = os.environ.get("SHINKAI_CALLER_PATH", os.environ.get("PATH", ""))
    if shutil.which("shinkai", path=path):
        return "shinkai"
    cwd = (cwd or Path.cwd()).resolve()
    script = SCRIPT.relative_to(cwd) if SCRIPT.is_relative_to(cwd) else SCRIPT
    return f"bash {shlex.quote(str(script))}"
