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


@pytest.fixture(scope="session")
def chat_llm():
    """The tiny model (it has a vision tower) in batch-invariant mode, for the image tests: greedy tokens
    then equal the full forward's exactly."""
    from services.engine import LLM

    return LLM(model="tiny", block_size=16, max_num_batched_tokens=24, max_num_seqs=8, batch_invariant=True)
