"""WorkerConfig: resolved sizes only, checked when it is made."""

import pytest

from services.worker.config import WorkerConfig

OK = {"block_size": 16, "num_blocks": 8, "num_state_slots": 3, "max_model_len": 64, "max_num_seqs": 2}


@pytest.mark.parametrize("name", OK)
def test_every_size_is_at_least_one(name):
    with pytest.raises(ValueError, match=name):
        WorkerConfig(**{**OK, name: 0})


def test_the_backend_is_torch_or_a_kernel_precision():
    assert WorkerConfig(**OK).kernel_backend is None
    assert WorkerConfig(**OK, kernel_backend="fp8").kernel_backend == "fp8"
    with pytest.raises(ValueError, match="kernel_backend"):
        WorkerConfig(**OK, kernel_backend="fp16")
