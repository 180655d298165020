"""build_worker: the one assembly of a worker, from the worker's share of the engine configuration."""

import pytest

from services.engine.config import EngineConfig
from services.worker.build import build_runner, build_worker
from services.worker.runners.model_runner import ModelRunner
from services.worker.spec.forced_acceptance import ForcedAcceptance
from tests.services.worker.spec.test_speculator import NEXTN, source  # noqa: F401  (the draft model fixture)

ENGINE = dict(device="cpu", max_model_len=96, block_size=8, max_num_seqs=4)


def test_without_drafts_the_worker_is_the_cached_runner_alone(source):  # noqa: F811
    worker = build_worker(source.model, EngineConfig(**ENGINE).worker_config())
    assert isinstance(worker.runner, ModelRunner) and worker.speculator is None
    assert worker.runner.cache.layout.draft_stages == 0  # no draft rings without drafts


def test_drafts_bring_a_speculator_and_the_draft_rings(source):  # noqa: F811
    config = EngineConfig(**ENGINE, num_speculative_tokens=NEXTN, spec_sampling="deterministic").worker_config()
    worker = build_worker(source.model, config, forced_acceptance=ForcedAcceptance(0.5))
    assert worker.speculator is not None
    assert (worker.speculator.nextn, worker.speculator.spec_sampling) == (NEXTN, "deterministic")
    assert worker.speculator.forced_acceptance.probability == 0.5
    assert worker.runner.cache.layout.draft_stages == len(source.model.draft.stages)


def test_a_given_runner_is_kept(source):  # noqa: F811
    config = EngineConfig(**ENGINE).worker_config()
    runner = build_runner(source.model, config)
    assert build_worker(source.model, config, runner=runner).runner is runner


def test_cuda_graphs_need_the_model_on_cuda(source):  # noqa: F811
    config = EngineConfig(**{**ENGINE, "kernel_backend": "fp8", "cuda_graphs": True, "async_scheduling": False})
    with pytest.raises(ValueError, match="cuda_graphs=True needs the model on a CUDA device"):
        build_worker(source.model, config.worker_config())


def test_capture_each_takes_the_sizes_largest_first_one_step_each():
    from services.worker import startup
    from services.worker.build import capture_each

    seen: list[tuple[list[int], startup.StartupState]] = []

    class Runner:
        def capture(self, sizes: list[int]) -> None:
            seen.append((sizes, startup.PROGRESS.state()))

    seconds = capture_each(Runner(), [1, 16, 4, 8, 2])
    assert [sizes for sizes, _ in seen] == [[16], [8], [4], [2], [1]]
    assert [(s.phase, s.done, s.total) for _, s in seen] == [("capturing", i, 5) for i in range(5)]
    assert list(seconds) == [16, 8, 4, 2, 1] and all(t >= 0 for t in seconds.values())
