"""Our model on its own: causality (prefix consistency), batch independence, the tiny forward time."""

from __future__ import annotations

import time

import pytest
import torch

from model.batch_invariant import batch_invariant
from tests import tolerances as tol
from tests.model.deepseek_v41.oracle_configs import CASES


def _prefix_check(model, ids: torch.Tensor, cuts: list[int]) -> None:
    """Prefix logits equal the full run's at the same positions, under ``==``: in batch-invariant mode
    every query reduces over the same keys in the same order at any length (model/batch_invariant.py)."""
    with torch.no_grad(), batch_invariant():
        full = model(ids)
        for cut in cuts:
            prefix = model(ids[:, :cut])
            assert torch.equal(prefix, full[:, :cut]), (
                f"cut {cut}: prefix logits differ by {float((prefix - full[:, :cut]).abs().max()):.3g}"
            )


@pytest.mark.parametrize("name", [c.name for c in CASES])
def test_prefix_logits_equal_full_sequence_logits(oracle_cases, name):
    built = oracle_cases[name]
    s = built.ids.shape[1]
    # Odd and even cuts: a cut inside a ratio-2 group and at candidate-block edges.
    _prefix_check(built.ours, built.ids, [1, 2, 7, 16, s // 2 + 1, s - 1])


def test_tiny_preset_prefix_consistency(tiny_model):
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(0))
    _prefix_check(tiny_model.model, ids, [9, 33])


def test_a_row_does_not_depend_on_its_batch_companions(oracle_cases):
    built = oracle_cases["oracle"]
    with torch.no_grad(), batch_invariant():
        both = built.ours(built.ids)
        alone = built.ours(built.ids[1:])
    assert torch.equal(both[1:], alone)


def test_changing_early_tokens_reaches_past_the_window(oracle_cases):
    """Tokens 0-3 lie outside the last query's window: only the compressed path can carry them."""
    built = oracle_cases["oracle"]
    ids2 = built.ids.clone()
    ids2[:, 0:4] = 7
    with torch.no_grad():
        moved = (built.ours(built.ids)[:, -1] - built.ours(ids2)[:, -1]).abs().max()
    assert float(moved) >= tol.SENSITIVITY_MIN_MOVE


def test_tiny_forward_time_64_tokens(tiny_model):
    """Benchmark note, not an assertion: the goal is well under a second on 2 cores."""
    ids = torch.randint(0, tiny_model.config.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.no_grad():
            t0 = time.perf_counter()
            tiny_model.model(ids)
            first = time.perf_counter() - t0
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                logits = tiny_model.model(ids)
                times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    print(f"\ntiny 1×64 forward on 2 threads: first {first:.3f}s, then best {min(times):.3f}s")
    assert logits.shape == (1, 64, 129280) and bool(torch.isfinite(logits).all())


def test_model_and_services_never_import_nemo_or_transformers():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    files = [*sorted((root / "model").rglob("*.py")), root / "services" / "entrypoints" / "model.py"]
    pattern = re.compile(r"^\s*(from|import)\s+(nemo_automodel|nemo|transformers)\b", re.MULTILINE)
    offenders = [str(f.relative_to(root)) for f in files if pattern.search(f.read_text())]
    assert offenders == []
