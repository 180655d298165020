"""Shared fixtures: each oracle case's checkpoint, our model and NeMo's, built once per session."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tests.model.deepseek_v41.oracle_configs import CASES, VISION_CASES, OracleCase, VisionCase, finish


@dataclasses.dataclass
class Built:
    case: OracleCase
    path: Path
    ours: torch.nn.Module
    nemo: torch.nn.Module
    nemo_missing: list[str]
    nemo_unexpected: list[str]
    ids: torch.Tensor


def build_case(case: OracleCase, root: Path) -> Built:
    pytest.importorskip("nemo_automodel")
    from model.deepseek_v41.init import write_random_checkpoint
    from model.deepseek_v41.loader import load_checkpoint
    from model.deepseek_v41.tokenizer import engram_token_map
    from tests.model.deepseek_v41.oracle_harness import nemo_model, toy_tokenizer

    tok = toy_tokenizer(case.cfg.vocab_size)
    cfg = finish(case.cfg, engram_token_map(tok)[1])
    path = write_random_checkpoint(root / case.name, cfg, case.seed, tok)
    ours = load_checkpoint(path).model
    nemo, missing, unexpected = nemo_model(path)
    return Built(case, path, ours, nemo, missing, unexpected, case_ids(case))


def case_ids(case: OracleCase) -> torch.Tensor:
    g = torch.Generator().manual_seed(case.seed)
    ids = torch.randint(3, case.cfg.vocab_size, (case.batch, case.seq_len), generator=g)
    ids[:, 5] = 4  # "The" then "THE": ids the Engram map merges, inside n-grams
    ids[:, 6] = 6
    if isinstance(case, VisionCase):
        ids[ids == case.cfg.vision.image_token_id] = 3  # placeholders only inside the image spans
        for row, span in enumerate(image_span_kinds(case)):
            ids[row, case.image_at : case.image_at + len(span)] = case.cfg.vision.image_token_id
    return ids


def image_span_kinds(case: VisionCase) -> list[list[int]]:
    """Per batch row, the kinds (start, image, newline, end) of its image span's positions."""
    from model.deepseek_v41.vision import span_kinds, span_rows_cols

    return [span_kinds(*span_rows_cols(grid, case.cfg.vision.downsample_ratio)) for grid in case.grids]


def image_patches(case: VisionCase) -> torch.Tensor:
    """Every row's image as normalised patches [Σ h·w, 3, p, p] in [-1, 1], rows in order."""
    p = case.cfg.vision.patch_size
    n = sum(h * w for h, w in case.grids)
    return torch.rand(n, 3, p, p, generator=torch.Generator().manual_seed(case.seed)) * 2 - 1


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """These models are tiny: one thread is as fast, and immune to OpenMP spin-waiting when the
    two CI cores are shared (we measured 100× slowdowns with 2 threads next to a busy process)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def oracle_cases(tmp_path_factory) -> dict[str, Built]:
    root = tmp_path_factory.mktemp("oracle")
    cache: dict[str, Built] = {}

    class Lazy(dict):
        def __missing__(self, name: str) -> Built:
            case = next(c for c in CASES + VISION_CASES if c.name == name)
            cache[name] = built = build_case(case, root)
            return built

    return Lazy()


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """``shinkai model init --preset tiny`` output (real DeepSeek vocabulary), written once."""
    from services.entrypoints.cli import main

    out = tmp_path_factory.mktemp("tiny") / "ckpt"
    assert main(["model", "init", "--preset", "tiny", "--out", str(out), "--seed", "5"]) == 0
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    from model.deepseek_v41.loader import load_checkpoint

    return load_checkpoint(tiny_checkpoint)
