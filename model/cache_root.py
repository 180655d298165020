"""The directory every Shinkai cache lives under: ``$SHINKAI_CACHE_DIR``, else ``$XDG_CACHE_HOME/shinkai``, else
``~/.cache/shinkai``. The tokenizer's patched vocabulary (model/deepseek_v41/tokenizer.py) and the kernel compile
caches (services/cache_dirs.py) take their directories under it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENV = "SHINKAI_CACHE_DIR"


def cache_root(environ: Mapping[str, str] = os.environ) -> Path:
    """The root (not created here), absolute: a process started elsewhere (`shinkai up`'s services run from the
    repository) finds the same directory. An empty variable counts as unset, as the XDG rules say."""
    if environ.get(ENV):
        return Path(environ[ENV]).expanduser().absolute()
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]).expanduser().absolute() / "shinkai"
    return Path.home() / ".cache" / "shinkai"
