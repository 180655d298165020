"""SchedulerConfig's binding: the pool sizes and batch limits have no defaults in the scheduler."""

import pytest

from scheduler_rs import SchedulerConfig

SIZES = {
    "block_size": 16,
    "num_blocks": 8,
    "num_state_slots": 3,
    "max_num_seqs": 2,
    "max_num_batched_tokens": 64,
    "max_model_len": 128,
}


@pytest.mark.parametrize("name", SIZES)
def test_each_size_must_be_given(name):
    """The user-facing defaults are EngineConfig's alone: leaving any size out is an error, not 256 sequences."""
    with pytest.raises(TypeError, match=name):
        SchedulerConfig(**{k: v for k, v in SIZES.items() if k != name})
    assert getattr(SchedulerConfig(**SIZES), name) == SIZES[name]
