"""Shinkai's scheduler and block manager, written in Rust (``scheduler_rs._core``).

DeepInfer's semantics with its numbers as defaults (docs/architecture.md, "The step loop"). The engine loop is
``plan = scheduler.schedule()`` → run the plan → ``scheduler.update(plan, result)``.
"""

from scheduler_rs._core import *  # noqa: F403 (the stub's __all__ lists the public surface)
from scheduler_rs._core import __all__  # noqa: F401
