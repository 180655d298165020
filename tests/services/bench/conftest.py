"""Fixtures shared by the bench tests."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest


@pytest.fixture
def draft_checkpoint(tmp_path) -> Path:
    """A random checkpoint of the first DSpark oracle config (a draft model) with its toy tokenizer."""
    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.tokenizer import engram_token_map
    from tests.model.deepseek_v41.oracle_configs import DRAFT_CASES, finish
    from tests.model.deepseek_v41.oracle_harness import toy_tokenizer

    case = DRAFT_CASES[0]
    tok = toy_tokenizer(case.cfg.vocab_size)
    return write_random_checkpoint(tmp_path / "ckpt", finish(case.cfg, engram_token_map(tok)[1]), case.seed, tok)


def run_main(module: ModuleType, argv: list[str]) -> None:
    """``module.main`` on ``argv`` parsed by its own ``add_arguments``, asserting exit 0; the benches set torch's
    thread count, which is put back afterwards."""
    import argparse

    import torch

    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        assert module.main(args) == 0
    finally:
        torch.set_num_threads(threads)
