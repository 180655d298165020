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


@pytest.fixture(scope="session")
def draft_source(tmp_path_factory):
    """The oracle-draft tiny config (vocabulary 256, a DSpark draft: a step takes milliseconds) as a loaded
    checkpoint, built with one torch thread."""
    import torch

    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.tokenizer import engram_token_map
    from services.engine.model_source import load_model
    from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES, finish
    from tests.model.deepseek_v41.oracle_harness import toy_tokenizer

    case = DRAFT_CASES[0]
    tok = toy_tokenizer(case.cfg.vocab_size)
    cfg = finish(case.cfg, engram_token_map(tok)[1])
    path = write_random_checkpoint(tmp_path_factory.mktemp("draft") / "ckpt", cfg, case.seed, tok)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(str(path))
    torch.set_num_threads(threads)
