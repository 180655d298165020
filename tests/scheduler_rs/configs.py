"""The sizes the scheduler tests run under.

The scheduler has no size defaults of its own (the user-facing ones are ``EngineConfig``'s, which the
engine passes in full); these are the sizes the tests were written against, and each test names what it
changes."""

from __future__ import annotations

from scheduler_rs import SchedulerConfig

SIZES = {
    "block_size": 128,
    "num_blocks": 4096,
    "num_state_slots": 257,
    "max_num_seqs": 256,
    "max_num_batched_tokens": 32768,
    "max_model_len": 1 << 20,
}


def scheduler_config(**changes: object) -> SchedulerConfig:
    return SchedulerConfig(**{**SIZES, **changes})  # type: ignore[arg-type]
