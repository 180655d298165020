"""Fixtures shared by the engine tests."""

import pytest

from services.engine.engine import Engine


@pytest.fixture
def pools_checked_after_every_step(monkeypatch):
    """Pool conservation and reference counts must hold after every engine step of the test."""
    step = Engine.step

    def checked(self):
        outputs = step(self)
        self.scheduler.check_invariants()
        return outputs

    monkeypatch.setattr(Engine, "step", checked)
